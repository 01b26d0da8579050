"""The sidecar as users run it: separate processes on one model dir (`cadence launch --sidecar`,
`cadence evaluate --continuous`), with retention churning, kill -9 and restarts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import ENV as RUN_ENV
from cli_run import popen, run_cadence

ROOT = Path(__file__).resolve().parents[2]
TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
STEPS = list(range(2, 31, 2))  # checkpoints every 2 steps up to 30
ENV = {**RUN_ENV, "COLUMNS": "200"}
cadence = partial(run_cadence, env={"COLUMNS": "200"})  # the CLI runner, 200 columns wide


def write_config(tmp_path: Path, *, max_to_keep, max_pending=14, eval_sleep=0.04, step_sleep=0.02) -> Path:
    cfg = {
        "task": {"class": TASK, "params": {"step_sleep": step_sleep, "eval_sleep": eval_sleep}},
        "trainer": {"train_steps": 30, "steps_per_loop": 2, "checkpoint_interval": 2, "max_to_keep": max_to_keep,
                    "seed": 0, "best_checkpoint": {"metric": "accuracy"}},
        "sidecar": {"mode": "every", "poll_interval": 0.05, "timeout": 120, "max_pending": max_pending},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def evaluations(model_dir: Path) -> list[dict]:
    return read_metrics(model_dir / "eval" / "evaluations.jsonl")


def committed(model_dir: Path) -> list[int]:
    ckpts = model_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpts.iterdir() if p.name.startswith("ckpt-") and (p / "MANIFEST.json").exists())


def test_churn_slow_sidecar_reads_every_checkpoint_and_none_deleted_under_it(tmp_path):
    # Steps slow enough that the sidecar evaluates (and releases) some checkpoints while the
    # trainer still saves: retention then has evaluated checkpoints to delete. 30 steps of 0.3 s:
    # under a loaded machine the sidecar's first evaluation can take ~6 s after its start.
    config = write_config(tmp_path, max_to_keep=2, step_sleep=0.3)
    model_dir = tmp_path / "run"
    proc = cadence("launch", str(config), "--sidecar", "--model-dir", str(model_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = evaluations(model_dir)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]
    out = proc.stdout
    assert "[trainer]" in out and "[sidecar]" in out
    trainer_lines = [line for line in out.splitlines() if line.startswith("[trainer]")]
    assert not [line for line in trainer_lines if "eval at step" in line]  # only the sidecar evaluates
    for bad in ("retrying", "skipping checkpoint", "failed to load", "corrupt"):
        assert bad not in out, bad
    left = committed(model_dir)
    assert len(left) < len(STEPS)  # retention really deleted evaluated checkpoints meanwhile
    assert len(left) <= 2 + 14  # max_to_keep + max_pending
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == 30
    assert not list((model_dir / "checkpoints" / ".leases").glob("*.json"))  # released at exit


def test_sidecar_killed_and_restarted_evaluates_each_step_once_with_the_same_best(tmp_path):
    config = write_config(tmp_path, max_to_keep=None, eval_sleep=0.1, step_sleep=0.0)
    model_dir = tmp_path / "run"
    trained = cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress",
                      "--set", "trainer.in_process_validation=false")
    assert trained.returncode == 0, trained.stderr
    reference = tmp_path / "reference"
    shutil.copytree(model_dir, reference)

    sidecar = [sys.executable, "-m", "cadence", "evaluate", str(config), "--model-dir", str(model_dir), "--continuous"]
    proc = popen(sidecar[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = model_dir / "eval" / "evaluations.jsonl"
    deadline = time.monotonic() + 120
    while (not log.exists() or len(evaluations(model_dir)) < 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(evaluations(model_dir))
    assert 4 <= done_before < len(STEPS), "killed too late to test a restart"
    assert list((model_dir / "checkpoints" / ".leases").glob("*.json"))  # its lease outlives it (expires)

    restarted = cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous")
    assert restarted.returncode == 0, restarted.stderr
    steps = [r["step"] for r in evaluations(model_dir)]
    assert steps == STEPS  # each once, in order, across the kill
    uninterrupted = cadence("evaluate", str(config), "--model-dir", str(reference), "--continuous")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    best = json.loads((model_dir / "best" / "best.json").read_text())
    expected = json.loads((reference / "best" / "best.json").read_text())
    assert (best["step"], best["value"]) == (expected["step"], expected["value"])
    assert json.loads(restarted.stdout)["best"] == json.loads(uninterrupted.stdout)["best"]


def test_dead_trainer_sidecar_exits_with_a_message(tmp_path):
    config = write_config(tmp_path, max_to_keep=None)
    model_dir = tmp_path / "run"
    (model_dir / "checkpoints").mkdir(parents=True)
    proc = cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous", "--timeout", "1")
    assert proc.returncode == 1
    assert "no new checkpoint" in proc.stderr and "no FINAL" in proc.stderr
    assert json.loads(proc.stdout)["stop_reason"] == "timeout"


def test_launch_sidecar_records_every_checkpoint_when_the_trainer_outruns_it(tmp_path):
    """Issue repro: digits saving every 50 steps with max_to_keep 1, and a sidecar that may hold back
    only one pending checkpoint: the trainer commits faster than the sidecar evaluates, retention
    deletes what the bounded lease lets go, and still every committed step has a record (evaluated,
    or skipped with the reason), the final one evaluated."""
    model_dir = tmp_path / "digits"
    sets = ["trainer.checkpoint_interval=50", "trainer.max_to_keep=1", "trainer.train_steps=300",
            "sidecar.max_pending=1", "trainer.validation_interval=null"]
    proc = cadence("launch", str(ROOT / "examples" / "digits" / "config.yaml"), "--sidecar",
                   "--model-dir", str(model_dir), *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["step"]: r for r in evaluations(model_dir)}
    assert sorted(rows) == [50, 100, 150, 200, 250, 300], rows
    assert rows[300]["status"] == "evaluated"
    assert all(r["status"] == "evaluated" or (r["status"] == "skipped" and "max_pending=1" in r["error"])
               for r in rows.values()), rows


def test_launch_sidecar_on_the_digits_example(tmp_path):
    model_dir = tmp_path / "digits"
    proc = cadence("launch", str(ROOT / "examples" / "digits" / "config.yaml"), "--sidecar",
                   "--model-dir", str(model_dir), "--profile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer: exit 0" in proc.stderr and "sidecar: exit 0" in proc.stderr
    # --profile: the trainer traced the default window (steps 13-15), once
    assert [p.name.split(".")[0] for p in (model_dir / "profile").iterdir()] == ["rank0"]
    assert not [line for line in proc.stdout.splitlines() if line.startswith("[trainer]") and "eval at" in line]
    rows = evaluations(model_dir)
    assert [r["step"] for r in rows] == committed(model_dir) == [200, 400, 600]
    assert all(r["status"] == "evaluated" for r in rows)
    best_row = max(rows, key=lambda r: r["metrics"]["accuracy"])
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert best["step"] == best_row["step"] and best["value"] == best_row["metrics"]["accuracy"]
    assert best["value"] >= 0.95


def test_launch_no_progress_silences_the_trainers_progress_lines(tmp_path):
    """``cadence launch --no-progress``, as ``cadence train --no-progress`` (issue 40): the trainer prints
    no progress line; without it, it prints them (plain lines: its output is a pipe)."""
    import re

    config = write_config(tmp_path, max_to_keep=None, eval_sleep=0.0, step_sleep=0.0)
    progress = re.compile(r"^\[trainer\]\s+step \d+/30 \(\d+%\)")
    shown = cadence("launch", str(config), "--sidecar", "--model-dir", str(tmp_path / "shown"))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert [line for line in shown.stdout.splitlines() if progress.match(line)], shown.stdout
    quiet = cadence("launch", str(config), "--sidecar", "--model-dir", str(tmp_path / "quiet"), "--no-progress")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "trainer: exit 0" in quiet.stderr and "[trainer] done:" in quiet.stdout
    assert not [line for line in quiet.stdout.splitlines() if progress.match(line)], quiet.stdout
