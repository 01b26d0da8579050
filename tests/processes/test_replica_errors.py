"""Replica groups that must not train together, and what a healing group takes over (torchft 0.2, a
real lighthouse, ``cadence train`` groups of one process started by hand as across machines, each
with its own model dir).

One shared run (``late_joins``): group 0 trains (``trainer.ema`` on); it is held still (the Task's
``hold_file``) while a group 1 starts, and let go once the lighthouse shows group 1 waiting for its
quorum -- so group 1 joins, and heals from group 0, at a step group 0 has reached:

- first a group 1 with another ``trainer.grad_clip_norm``: one stderr line naming the field, exit 2,
  nothing written in its model dir; group 0 goes on alone;
- then a group 1 with the same config: it heals from group 0 mid-run (its EMA included) and both end
  at the last step with the same EMA, bit for bit (tolerance below). An EMA restarted at the healing
  step from the healed weights, as before, would differ from group 0's by ``decay ** (steps after
  healing)`` (0.99 ** <= 30 > 0.7) times the gap between the EMA and the weights then: the test also
  checks that the EMA is far from the weights.

A group of another world size (``cadence train --nproc 2`` against one process) is refused the same
way: skipped until groups of several processes exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cadence.cluster.replica_groups import free_port, lighthouse_program
from cli_run import popen
from configs import write_config

pytest.importorskip("torchft")

STEPS = 40
TOLERANCE = 1e-6
"""Max absolute difference between the two groups' final EMA weights. Measured: 0.0 (after healing
both groups step the same weights with the same averaged gradient)."""
WAITING = "[1/1 participants healthy][2 heartbeating]"
"""The lighthouse's status while group 0 is held and group 1 waits for its quorum (torchft 0.2's words)."""


def metrics(model_dir: Path) -> list[dict]:
    path = model_dir / "train" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def lighthouse_status(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return response.read().decode()


def wait_for(condition, what: str, *alive: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(p.poll() is None for p in alive), f"a process ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_lighthouse(root: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    with open(root / "lighthouse.log", "wb") as log:
        proc = subprocess.Popen([lighthouse_program(sys.executable), "--bind", f"127.0.0.1:{port}", "--min_replicas",
                                 "1", "--join_timeout_ms", "100", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms",
                                 "1000"], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
    wait_for(lambda: _accepts(port), "the lighthouse", proc, timeout=15)
    return proc, port


def _accepts(port: int) -> bool:
    try:
        lighthouse_status(port)
        return True
    except OSError:
        return False


def group_argv(config: Path, model_dir: Path, replica_id: int, *sets: str) -> list[str]:
    args = ["-m", "cadence", "train", str(config), "--model-dir", str(model_dir), "--no-progress",
            "--set", f"trainer.fault_tolerance.replica_id={replica_id}"]
    return args + [a for s in sets for a in ("--set", s)]


def join_held(hold: Path, port: int, argv: list[str], group0: subprocess.Popen, **kwargs) -> subprocess.Popen:
    """Start a group 1 while group 0 is held; let group 0 go once group 1 waits for its quorum."""
    hold.touch()
    proc = popen(argv, **kwargs)
    try:
        wait_for(lambda: WAITING in lighthouse_status(port), "group 1's quorum request", proc, group0)
    finally:
        hold.unlink()
    return proc


@pytest.fixture(scope="module")
def late_joins(tmp_path_factory):
    """Group 0 of 2 (EMA on), joined by a group 1 of another config (refused), then by one of the same
    config (healed). ``(root, group 0's exit code and output, the refused group's exit code, stdout
    and stderr, the healed group's exit code and output)``."""
    root = tmp_path_factory.mktemp("replica_errors")
    lighthouse, port = start_lighthouse(root)
    hold = root / "hold"
    config = write_config(root, params={"step_sleep": 0.05, "hold_file": str(hold)},
                          trainer={"train_steps": STEPS, "steps_per_loop": 2, "checkpoint_interval": None,
                                   "validation_interval": None, "ema": {"decay": 0.99},
                                   "fault_tolerance": {"replica_groups": 2, "min_replicas": 1,
                                                       "lighthouse": f"http://127.0.0.1:{port}"}})
    procs: list[subprocess.Popen] = []
    try:
        with open(root / "group0.log", "wb") as out0:
            group0 = popen(group_argv(config, root / "g0", 0), stdout=out0, stderr=subprocess.STDOUT)
            procs.append(group0)
            wait_for(lambda: any(r["step"] >= 4 for r in metrics(root / "g0")), "group 0's 4th step", group0)
            bad = join_held(hold, port, group_argv(config, root / "g1_bad", 1, "trainer.grad_clip_norm=1.0"), group0,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(bad)
            bad_out, bad_err = bad.communicate(timeout=120)
            after = max(r["step"] for r in metrics(root / "g0"))
            wait_for(lambda: max(r["step"] for r in metrics(root / "g0")) >= after + 2, "group 0 alone", group0)
            with open(root / "group1.log", "wb") as out1:
                good = join_held(hold, port, group_argv(config, root / "g1", 1), group0,
                                 stdout=out1, stderr=subprocess.STDOUT)
                procs.append(good)
                good.wait(timeout=180)
            group0.wait(timeout=180)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.kill()
        lighthouse.wait()
    return (root, (group0.returncode, (root / "group0.log").read_text()), (bad.returncode, bad_out, bad_err),
            (good.returncode, (root / "group1.log").read_text()))


def one_line_exit_2(code: int, stdout: str, stderr: str, *words: str) -> None:
    """Exit 2 with one error line holding ``words``, no traceback (the lines before it are the group's
    log: it had started)."""
    assert code == 2, stdout + stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("cadence: error: ") and all(w in errors[0] for w in words), stderr
    assert "Warning" not in stderr, stderr


def test_a_group_of_another_config_is_refused_in_one_line_and_its_peer_goes_on(late_joins):
    root, (code0, out0), bad, _ = late_joins
    one_line_exit_2(*bad, "replica group 1 cannot join group 0: its config differs from group 0's in "
                          "trainer.grad_clip_norm (")
    assert not (root / "g1_bad").exists()  # refused before it trained: nothing written for it
    assert code0 == 0, out0
    assert [r["step"] for r in metrics(root / "g0")] == list(range(2, STEPS + 1, 2))  # every loop once


def test_a_healed_group_takes_its_peers_ema(late_joins):
    root, (code0, out0), _, (code1, out1) = late_joins
    assert code0 == 0 and code1 == 0, out0 + out1
    healed = [int(m) for m in re.findall(r"replica group 1 healed from a live peer at step (\d+)", out1)]
    assert len(healed) == 1 and 4 < healed[0] < STEPS, out1  # mid-run, from group 0's state
    last = Path("checkpoints") / f"ckpt-{STEPS}"
    ema0, ema1 = (load_file(root / g / last / "ema.safetensors") for g in ("g0", "g1"))
    weights = load_file(root / "g0" / last / "model.safetensors")
    difference = max(float((ema0[k] - ema1[k]).abs().max()) for k in ema0)
    gap = max(float((ema0[k] - weights[k]).abs().max()) for k in ema0)
    print(f"healed at step {healed[0]}; EMA group 0 vs group 1: {difference:.3g}; EMA vs weights: {gap:.3g}")
    assert ema0.keys() == ema1.keys() and difference <= TOLERANCE
    assert gap > 1000 * TOLERANCE  # the EMA carries history a restart from the healed weights would lose


def test_a_group_of_another_world_size_is_refused_in_one_line(tmp_path):
    lighthouse, port = start_lighthouse(tmp_path)
    hold = tmp_path / "hold"
    config = write_config(tmp_path, params={"step_sleep": 0.05, "hold_file": str(hold)},
                          trainer={"train_steps": 30, "steps_per_loop": 2, "checkpoint_interval": None,
                                   "validation_interval": None,
                                   "fault_tolerance": {"replica_groups": 2, "lighthouse": f"http://127.0.0.1:{port}"}})
    group0 = popen(group_argv(config, tmp_path / "g0", 0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(r["step"] >= 2 for r in metrics(tmp_path / "g0")), "group 0's 2nd step", group0)
        # its rank 1 has no peer of its group rank: it waits timeout_s in torchft before the group takes rank 0's verdict
        argv = group_argv(config, tmp_path / "g1", 1) + ["--nproc", "2", "--set", "trainer.fault_tolerance.timeout_s=4"]
        wider = join_held(hold, port, argv, group0, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = wider.communicate(timeout=120)
        one_line_exit_2(wider.returncode, out, err, "replica group 1 cannot join group 0: it runs 2 process(es), "
                                                    "group 0 runs 1 (")
        assert not (tmp_path / "g1").exists()
        assert group0.wait(timeout=120) == 0
    finally:
        for proc in (group0, lighthouse):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
