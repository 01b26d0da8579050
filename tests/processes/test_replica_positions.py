"""Every replica group's data position in the checkpoint, and the samples skipped and read twice
(``trainer.fault_tolerance``, torchft 0.2): ``cadence launch --replicas 2`` with a real lighthouse,
group 1 killed with kill -9 in the second step of a loop (it has committed a step since the loop end
where the groups last exchanged their positions) and restarted by the launcher.

- the final checkpoint's ``replica_data`` holds each group's position, equal to what that group's
  loader really stood at after its last batch (recorded by the task itself, ``position_dir``), and
  group 0's equals the batches it drew: every committed step's and every dropped step's
  (``replica_retries``);
- ``replica_samples_skipped`` counts the dropped steps' samples; group 1's ``replica_samples_repeated``
  the batches both its processes drew, less the one in flight at the kill if it was never committed;
  ``cadence report`` shows the steps run with 1 group and the metrics' sums;
- a resume of the whole run from the checkpoints (both groups restarted) continues each group from
  its own row.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_run import popen, run_cadence
from configs import write_config

pytest.importorskip("torchft")

STEPS = 24
MORE = 3  # steps of the resume
BATCH = 8
GROUPS = 2
EPOCH_BATCHES = 200 // (BATCH * GROUPS)  # TinyTask's 200 samples, drop_last over 2 shards


def metrics(directory: Path) -> list[dict]:
    path = directory / "train" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def group_dir(model_dir: Path, group: int) -> Path:
    return model_dir if group == 0 else model_dir / "replicas" / f"group{group}"


def state(model_dir: Path, step: int) -> dict:
    return json.loads((model_dir / "checkpoints" / f"ckpt-{step}" / "state.json").read_text())["state"]["trainer"]


def processes(positions: Path, group: int) -> list[list[tuple[int, int]]]:
    """The loader positions after each batch of group ``group``'s processes, oldest first."""
    files = sorted(positions.glob(f"group{group}.*"), key=lambda p: p.stat().st_mtime)
    return [[tuple(map(int, line.split())) for line in f.read_text().splitlines()] for f in files]


def drawn(positions: Path, group: int) -> int:
    return sum(len(p) for p in processes(positions, group))


def last_positions(positions: Path, group: int) -> list[tuple[int, int]]:
    """The loader positions after each batch of group ``group``'s newest process."""
    return processes(positions, group)[-1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``launch --replicas 2``, group 1 killed a few steps in, then the whole run resumed for MORE steps."""
    root = tmp_path_factory.mktemp("ft_positions")
    pids, positions = root / "pids", root / "positions"
    pids.mkdir()
    positions.mkdir()
    trainer = {"train_steps": STEPS, "steps_per_loop": 3, "checkpoint_interval": 12, "validation_interval": None,
               "fault_tolerance": {"replica_groups": GROUPS, "min_replicas": 1, "heartbeat_timeout_s": 1.0}}
    params = {"step_sleep": 0.08, "pid_dir": str(pids), "restart_sleep": 1.5, "position_dir": str(positions)}
    config = write_config(root, params=params, trainer=trainer)
    model_dir = root / "model"
    log = root / "launch.log"
    began = time.monotonic()
    with open(log, "wb") as out:
        proc = popen(["-m", "cadence", "launch", str(config), "--model-dir", str(model_dir), "--replicas", "2"],
                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            # group 1 killed in the second step of a loop (loops of 3 steps end at multiples of 3): it has
            # committed the loop's first step since the exchange at the last loop end. Its steps count from
            # the step it healed at when it joined after group 0 had started, else from 0.
            while not (pids / "group1").exists() or drawn(positions, 1) < 4:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.01)
            joined = re.findall(r"replica group 1 healed from a live peer at step (\d+)", log.read_text())
            start = int(joined[0]) if joined else 0
            while (start + drawn(positions, 1)) % 3 != 2:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.005)
            os.kill(int((pids / "group1").read_text()), signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log.read_text()
    print(f"killed run: {time.monotonic() - began:.1f} s")
    first = {g: processes(positions, g) for g in range(GROUPS)}
    saved = state(model_dir, STEPS)
    more = write_config(root / "more", params={**params, "restart_sleep": 0.0}, trainer={**trainer, "train_steps": STEPS + MORE})
    began = time.monotonic()
    resumed = run_cadence("launch", str(more), "--model-dir", str(model_dir), "--replicas", "2")
    print(f"resume: {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    report = run_cadence("report", str(model_dir))
    print(f"report: {time.monotonic() - began:.1f} s")
    return {"model_dir": model_dir, "output": output, "code": code, "first": first, "saved": saved,
            "positions": positions, "resumed": resumed, "report": report}


def loader_state(row: dict) -> tuple[int, int]:
    assert row["data"]["kind"] == "stateful", row
    return row["data"]["state"]["epoch"], row["data"]["state"]["offset"]


def test_the_checkpoint_holds_every_groups_own_position(run):
    assert run["code"] == 0, run["output"]
    saved = run["saved"]
    assert saved["replica_groups"] == GROUPS and saved["replica_writer"] == 0
    rows = saved["replica_data"]
    assert len(rows) == GROUPS and all(isinstance(r, dict) for r in rows), rows
    for group in range(GROUPS):  # what each group's loader really stood at after its last batch
        assert loader_state(rows[group]) == run["first"][group][-1][-1], (group, rows[group])
    # group 0 was never restarted: it drew one batch per committed step and per dropped step
    rows0 = metrics(run["model_dir"])
    retries = int(sum(r["replica_retries"] for r in rows0[:STEPS // 3]))
    batches = STEPS + retries
    assert loader_state(rows[0]) == (batches // EPOCH_BATCHES, batches % EPOCH_BATCHES * BATCH * GROUPS)
    assert rows[0]["samples"] == batches * BATCH and rows[0]["committed"] == batches * BATCH
    assert loader_state(rows[1]) != loader_state(rows[0])  # group 1 missed the steps group 0 ran alone


def test_skipped_and_repeated_samples_are_counted(run):
    for group in range(GROUPS):
        rows = metrics(run["model_dir"] if group == 0 else run["model_dir"] / "replicas" / f"group{group}")
        assert rows and all("replica_samples_skipped" in r and "replica_samples_repeated" in r for r in rows)
        for r in rows:  # one batch of BATCH samples per dropped step
            assert r["replica_samples_skipped"] == BATCH * r["replica_retries"], r
    # group 1, killed and restarted: what it read again are the batches both its processes drew, less
    # the one in flight when it died (drawn, never committed) when the kill came before its commit
    before, after = run["first"][1]
    again = len(set(before) & set(after))
    repeated = sum(r["replica_samples_repeated"] for r in metrics(group_dir(run["model_dir"], 1)))
    print(f"group 1: {len(before)} batches before the kill, {len(after)} after, {again} drawn by both; "
          f"repeated samples counted: {repeated:g}")
    assert again >= 1 and repeated in (BATCH * again, BATCH * (again - 1)), (repeated, again)
    assert repeated >= BATCH  # the loop's first step, committed after the last exchange, was read again
    assert sum(r["replica_samples_repeated"] for r in metrics(run["model_dir"])) == 0  # group 0 never went back


def test_a_resume_continues_each_group_from_its_own_row(run):
    assert run["resumed"].returncode == 0, run["resumed"].stdout + run["resumed"].stderr
    rows = run["saved"]["replica_data"]
    for group in range(GROUPS):
        after = last_positions(run["positions"], group)
        epoch, offset = loader_state(rows[group])
        step = BATCH * GROUPS  # the position moves by one batch of every shard
        following = (epoch, offset + step) if offset + step < EPOCH_BATCHES * step else (epoch + 1, 0)
        assert after[0] == following, (group, after[:2], rows[group])


def test_the_report_shows_the_replica_groups(run):
    report = run["report"]
    assert report.returncode == 0, report.stderr
    html = (run["model_dir"] / "report.html").read_text()
    assert "Replica groups" in html
    rows = [r for g in range(GROUPS) for r in metrics(group_dir(run["model_dir"], g))]
    skipped = int(sum(r["replica_samples_skipped"] for r in rows))
    repeated = int(sum(r["replica_samples_repeated"] for r in rows))
    assert f"samples skipped: {skipped}" in html and f"samples seen twice: {repeated}" in html, html
    shown = re.search(r"steps with fewer than 2 groups: ([0-9, -]+);", html)
    ranges = [tuple(map(int, part.split("-"))) if "-" in part else (int(part),) * 2
              for part in shown.group(1).split(", ")]
    alone = [r["step"] for r in metrics(run["model_dir"]) if r["replicas"] == 1]
    assert alone and all(any(a <= s <= b for a, b in ranges) for s in alone), (alone, ranges)
    short = {r["step"] for g in range(GROUPS) for r in metrics(group_dir(run["model_dir"], g)) if r["replicas"] < 2}
    assert all(b in short for _, b in ranges), (ranges, short)
