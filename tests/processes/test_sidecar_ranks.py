"""A sidecar of several ranks (`cadence evaluate --continuous --nproc N`) on a 2-rank FSDP trainer's
run: it follows the live trainer, its chief alone records, its metrics equal the trainer's
in-process evaluation, a 1-rank sidecar agrees, a rank killed with kill -9 is resumed with restarts
(every step recorded once) or ends it in one line without, and it runs on two nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.cluster.launch import sidecar_commands
from cadence.summaries.metrics_file import read_metrics
from cli_run import popen, run_cadence
from configs import write_config
from multinode import free_port, listening, wait_until

STEPS = [4, 8, 12, 16]
NO_BEST = ("--set", "trainer.best_checkpoint=null")  # best/ is the first sidecar's alone


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-rank FSDP trainer (in-process validation at each checkpoint) and, beside it from its
    start, a 2-rank sidecar (``--name two``) evaluating its checkpoints as they are committed."""
    tmp = tmp_path_factory.mktemp("sidecar-ranks")
    config = write_config(tmp, params={"n": 256, "step_sleep": 0.05}, trainer={
        "train_steps": 16, "checkpoint_interval": 4, "validation_interval": 4, "strategy": "fsdp",
        "best_checkpoint": {"metric": "loss", "higher_is_better": False}},
        sidecar={"poll_interval": 0.05, "timeout": 120})
    model_dir = tmp / "run"
    sidecar = popen(["-m", "cadence", "evaluate", str(config), "--model-dir", str(model_dir), "--continuous",
                     "--nproc", "2", "--name", "two"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trained = run_cadence("train", str(config), "--model-dir", str(model_dir), "--nproc", "2", "--no-progress",
                          *NO_BEST)
    out, err = sidecar.communicate(timeout=240)
    assert trained.returncode == 0, trained.stderr
    assert sidecar.returncode == 0, err
    return config, model_dir, out, err


def records(model_dir: Path, name: str) -> list[dict]:
    return read_metrics(model_dir / f"eval_{name}" / "evaluations.jsonl")


def in_process(model_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in ("loss", "accuracy")} for r in read_metrics(model_dir / "eval" / "metrics.jsonl")}


def test_a_two_rank_sidecar_follows_the_trainer_with_its_in_process_metrics_exactly(run):
    config, model_dir, out, err = run
    rows = records(model_dir, "two")
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]  # the chief's, each once
    # the same sharded model on the same 2 data shards as the trainer's evaluation: the same arithmetic
    assert {r["step"]: r["metrics"] for r in rows} == in_process(model_dir)
    assert "evaluating on 2 ranks: the model sharded over them (FSDP2)" in err and "a sidecar of 2 ranks" in err
    result = json.loads(out)  # one line, the chief's, without torchrun's rank prefix
    assert result["evaluated"] == STEPS and result["stop_reason"] == "final"
    best = json.loads((model_dir / "best" / "best.json").read_text())
    expected = min(rows, key=lambda r: r["metrics"]["loss"])
    assert (best["step"], best["value"]) == (expected["step"], expected["metrics"]["loss"])
    assert (result["best"]["step"], result["best"]["value"]) == (best["step"], best["value"])
    eval_dir = model_dir / "eval_two"
    assert [r["step"] for r in read_metrics(eval_dir / "metrics.jsonl")] == STEPS  # summaries: the chief's alone
    assert len(list(eval_dir.glob("events.out.tfevents.*"))) == 1
    assert not list((model_dir / "checkpoints" / ".leases").glob("*.json"))  # the chief's lease, released


def test_a_one_rank_sidecar_on_the_same_run_agrees(run):
    config, model_dir, _, _ = run
    proc = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous", "--name", "one",
                       *NO_BEST)
    assert proc.returncode == 0, proc.stderr
    rows = records(model_dir, "one")
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]
    # one process sums the 64 samples in other batches (float32 means of 16, not of 32): within rounding
    expected = in_process(model_dir)
    for r in rows:
        assert r["metrics"] == pytest.approx(expected[r["step"]], rel=1e-6, abs=0)


def _kill_rank1_mid_run(config: Path, model_dir: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """A 2-rank sidecar ``name`` with slow evaluations; rank 1 killed with SIGKILL once the first
    step is recorded. Returns the process, its stdout and stderr."""
    pids = model_dir.parent / f"pids-{name}"
    pids.mkdir()
    proc = popen(["-m", "cadence", "evaluate", str(config), "--model-dir", str(model_dir), "--continuous",
                  "--nproc", "2", "--name", name, *NO_BEST, "--set", "task.params.eval_sleep=0.5",
                  "--set", f"task.params.pid_dir={pids}", *extra],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = model_dir / f"eval_{name}" / "evaluations.jsonl"
    deadline = time.monotonic() + 120
    while (not log.exists() or not records(model_dir, name)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(records(model_dir, name)) < len(STEPS), "killed too late"
    os.kill(int((pids / "rank1").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    return proc, out, err


def test_a_rank_killed_with_restarts_resumes_and_records_every_step_once(run):
    config, model_dir, _, _ = run
    proc, out, err = _kill_rank1_mid_run(config, model_dir, "restarted", "--max-restarts", "1")
    assert proc.returncode == 0, err
    rows = records(model_dir, "restarted")
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]
    assert "torchrun restarted the sidecar after a failure (restart 1 of --max-restarts 1)" in err
    assert "resuming after step" in err
    assert {r["step"]: r["metrics"] for r in rows} == in_process(model_dir)
    assert json.loads(out)["stop_reason"] == "final"


def test_a_rank_killed_without_restarts_fails_in_one_line(run):
    config, model_dir, _, _ = run
    proc, out, err = _kill_rank1_mid_run(config, model_dir, "lost")
    assert proc.returncode != 0
    failed = [line for line in err.splitlines() if line.startswith("cadence: failed:")]
    assert len(failed) == 1, err
    assert "rank 1 (local rank 1, pid" in failed[0] and "was killed by SIGKILL" in failed[0], failed
    assert "after the last step in evaluations.jsonl" in failed[0]
    assert out == ""
    steps = [r["step"] for r in records(model_dir, "lost")]
    assert steps == STEPS[:len(steps)] and steps  # what was recorded, once each, in order


def test_a_sidecar_on_two_nodes_prints_one_line_from_the_node_of_its_chief(run):
    """``--nnodes 2`` (one process a node, on 127.0.0.1): the node whose worker the rendezvous made rank 0
    prints the line, the other nothing; both exit 0, and the records are the 2-rank sidecar's."""
    config, model_dir, _, _ = run
    port = free_port()
    args = ["-m", "cadence", "evaluate", str(config), "--model-dir", str(model_dir), "--continuous", "--nproc", "1",
            "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--name", "nodes", *NO_BEST]
    first = popen([*args, "--node-rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until("node 0's rendezvous store", lambda: listening(port), procs=[first])
    second = popen([*args, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = [node.communicate(timeout=240) for node in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), [err for _, err in outputs]
    lines = [out for out, _ in outputs if out.strip()]
    assert len(lines) == 1 and json.loads(lines[0])["evaluated"] == STEPS
    assert {r["step"]: r["metrics"] for r in records(model_dir, "nodes")} == in_process(model_dir)


def test_launch_gives_the_sidecar_its_size(tmp_path):
    commands = sidecar_commands("c.yaml", str(tmp_path), nproc=2, sidecar_nproc=2, python=sys.executable)
    assert commands["sidecar"][-3:] == ["--continuous", "--nproc", "2"]
    assert commands["trainer"][-2:] == ["--nproc", "2"]


@pytest.mark.parametrize("args, message", [
    (("--nnodes", "2"), "--nnodes: only for a sidecar of several ranks (--continuous --nproc N)"),
    (("--continuous", "--max-restarts", "1"), "--max-restarts need --nproc N"),
    (("--continuous", "--nproc", "2", "--max-restarts", "-1"), "--max-restarts: must be >= 0, got -1"),
])
def test_bad_sidecar_ranks_flags_are_one_line_errors(tmp_path, args, message):
    config = write_config(tmp_path)
    proc = run_cadence("evaluate", str(config), "--model-dir", str(tmp_path / "run"), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
