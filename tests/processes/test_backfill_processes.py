"""Backfills as users run them: ``cadence evaluate CONFIG --model-dir MD --all`` / ``--steps`` under a
``--name``, on one finished TinyTask run (copied per test): each checkpoint without a record is
evaluated once, oldest first; a backfill killed with kill -9 and run again does only what is left,
with the metrics of a backfill that was not killed; bad input is one line, exit 2, nothing created."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.cli.main import main
from cadence.summaries.metrics_file import read_metrics
from cli_run import popen, run_cadence
from configs import write_config

STEPS = [2, 4, 6, 8, 10, 12]
TRAINER = {"train_steps": 12, "steps_per_loop": 2, "checkpoint_interval": 2, "validation_interval": None,
           "in_process_validation": False, "best_checkpoint": {"metric": "accuracy"}}


def rows(model_dir: Path, name: str = "late") -> list[dict]:
    return read_metrics(model_dir / f"eval_{name}" / "evaluations.jsonl")


def backfill(config: Path, model_dir: Path, *args: str) -> dict:
    """``cadence evaluate CONFIG --model-dir MODEL_DIR --name late ARGS...``: exit 0, its JSON summary."""
    proc = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--name", "late", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, model dir) of a finished run without in-process evaluation: checkpoints 2..12."""
    root = tmp_path_factory.mktemp("backfill")
    config = write_config(root, trainer=TRAINER)
    model_dir = root / "run"
    trained = run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    return config, model_dir


@pytest.fixture(scope="module")
def reference(finished: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A copy of the finished run backfilled with ``--all`` once, without a kill; (its model dir, the summary)."""
    config, model_dir = finished
    copy = tmp_path_factory.mktemp("reference") / "run"
    shutil.copytree(model_dir, copy)
    return copy, backfill(config, copy, "--all")


def copy_of(finished: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(finished[1], tmp_path / "run")
    return tmp_path / "run"


def test_all_on_a_finished_run_evaluates_each_checkpoint_once_oldest_first(finished, reference):
    config, _ = finished
    model_dir, summary = reference
    records = rows(model_dir)
    assert [(r["step"], r["status"]) for r in records] == [(s, "evaluated") for s in STEPS]
    assert summary["stop_reason"] == "backfilled" and summary["evaluated"] == STEPS
    best_row = max(records, key=lambda r: r["metrics"]["accuracy"])  # the first of the best: a tie is no improvement
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert (best["step"], best["value"]) == (best_row["step"], best_row["metrics"]["accuracy"])
    assert summary["best"] == {"metric": "accuracy", "step": best_row["step"], "value": best_row["metrics"]["accuracy"]}
    one = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--checkpoint", "6")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == {"step": 6, **records[2]["metrics"]}  # what evaluate says of that checkpoint
    # run again: nothing left; a sidecar of that name then has nothing to do either
    assert backfill(config, model_dir, "--all")["evaluated"] == []
    sidecar = backfill(config, model_dir, "--continuous")
    assert sidecar["stop_reason"] == "final" and sidecar["evaluated"] == []
    assert rows(model_dir) == records
    assert not list((model_dir / "checkpoints" / ".leases").glob("*.json"))  # released
    assert not (model_dir / "eval").exists()  # only eval_late/


def test_steps_then_all_evaluate_each_checkpoint_once(finished, reference, tmp_path):
    config, _ = finished
    model_dir = copy_of(finished, tmp_path)
    assert backfill(config, model_dir, "--steps", "8,4")["evaluated"] == [4, 8]
    assert backfill(config, model_dir, "--all")["evaluated"] == [2, 6, 10, 12]
    expected = {r["step"]: r["metrics"] for r in rows(reference[0])}
    assert [(r["step"], r["metrics"]) for r in rows(model_dir)] == [(s, expected[s]) for s in (4, 8, 2, 6, 10, 12)]


def test_a_backfill_killed_and_run_again_evaluates_each_checkpoint_once(finished, reference, tmp_path, capsys):
    config, _ = finished
    model_dir = copy_of(finished, tmp_path)
    argv = ["evaluate", str(config), "--model-dir", str(model_dir), "--name", "late", "--all"]
    slow = popen(["-m", "cadence", *argv, "--set", "task.params.eval_sleep=0.5"],  # 2 s per checkpoint
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = model_dir / "eval_late" / "evaluations.jsonl"
    deadline = time.monotonic() + 120
    while not log.exists() and time.monotonic() < deadline and slow.poll() is None:
        time.sleep(0.02)
    assert slow.poll() is None and log.exists(), "no record before the backfill ended"
    # while it runs, nothing else evaluates under its name: one line, exit 2, nothing started
    launch = ["launch", str(config), "--sidecar", "--model-dir", str(model_dir), "--set", "sidecar.name=late"]
    for other in (argv, [*argv[:-1], "--continuous"], launch):
        assert main(other) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("cadence: error: another evaluator runs as 'sidecar-late'") and "\n" not in err, err
        assert f"pid {slow.pid} on host" in err
    os.kill(slow.pid, signal.SIGKILL)
    slow.wait()
    done_before = [r["step"] for r in rows(model_dir)]
    assert 1 <= len(done_before) < len(STEPS), "killed too late to test a rerun"
    assert (model_dir / "checkpoints" / ".leases" / "sidecar-late.json").exists()  # left by the killed process

    rerun = backfill(config, model_dir, "--all")  # its lease is left by a dead process of this host: free
    assert rerun["evaluated"] == [s for s in STEPS if s not in done_before]
    assert [r["step"] for r in rows(model_dir)] == STEPS  # each once, in order, across the kill
    expected = {r["step"]: r["metrics"] for r in rows(reference[0])}
    assert {r["step"]: r["metrics"] for r in rows(model_dir)} == expected
    assert rerun["best"] == reference[1]["best"]
    best, expected_best = (json.loads((d / "best" / "best.json").read_text()) for d in (model_dir, reference[0]))
    assert (best["step"], best["value"]) == (expected_best["step"], expected_best["value"])


def test_a_backfill_while_the_trainer_runs_ends_with_its_list_and_a_rerun_does_what_came_later(tmp_path):
    """The trainer (retention: max_to_keep 2) held mid-run: a backfill evaluates the checkpoints
    committed when it started and ends without waiting for FINAL; the trainer then finishes, and the
    backfill run again evaluates only what was committed since and is still there."""
    hold = tmp_path / "hold"
    config = write_config(tmp_path, params={"hold_file": str(hold), "step_sleep": 0.02},
                          trainer={**TRAINER, "train_steps": 16, "max_to_keep": 2})
    model_dir = tmp_path / "run"
    trainer = popen(["-m", "cadence", "train", str(config), "--model-dir", str(model_dir), "--no-progress"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (model_dir / "checkpoints" / "ckpt-6" / "MANIFEST.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        hold.touch()  # the trainer waits at its next step: mid-run, no FINAL
        first = backfill(config, model_dir, "--all")
        assert first["stop_reason"] == "backfilled" and first["evaluated"], first
        assert trainer.poll() is None and not (model_dir / "checkpoints" / "FINAL").exists()
    finally:
        hold.unlink(missing_ok=True)
        assert trainer.wait(120) == 0
    second = backfill(config, model_dir, "--all")
    records = rows(model_dir)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and 16 in steps  # each once, oldest first, the final one too
    assert steps == first["evaluated"] + first["skipped"] + second["evaluated"] + second["skipped"]
    assert all(r["status"] == "evaluated" or "deleted" in r["error"] for r in records), records


def tree(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) + "/" * p.is_dir() for p in top.rglob("*"))


BAD = [
    (["--steps", "3"], "no committed checkpoint at step 3 in {md}/checkpoints (committed: 2, 4, 6, 8, 10, 12)"),
    (["--steps", "2,x"], "--steps: expected step numbers >= 0 separated by commas (e.g. 100,200,300), got '2,x'"),
    (["--steps", ""], "--steps: expected step numbers >= 0 separated by commas (e.g. 100,200,300), got ''"),
    (["--all", "--steps", "2"], "--all and --steps exclude each other (--all: every committed checkpoint)"),
    (["--all", "--continuous"], "--all evaluates the committed checkpoints without a record, on one process, "
                                "then stops: leave out --continuous"),
    (["--steps", "2", "--checkpoint", "2"], "--steps evaluates the committed checkpoints without a record, on one "
                                            "process, then stops: leave out --checkpoint"),
    (["--all", "--initial", "--nproc", "2"], "--all evaluates the committed checkpoints without a record, on one "
                                             "process, then stops: leave out --initial, --nproc"),
    (["--all", "--mode", "every", "--timeout", "3"], "--all evaluates the committed checkpoints without a record, "
                                                     "on one process, then stops: leave out --mode, --timeout"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_creates_nothing(finished, capsys, args, message):
    config, model_dir = finished
    before = tree(model_dir.parent)
    assert main(["evaluate", str(config), "--model-dir", str(model_dir), "--name", "late", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"cadence: error: {message.format(md=model_dir)}", err
    assert tree(model_dir.parent) == before


def test_a_model_dir_without_checkpoints_is_refused(finished, tmp_path, capsys):
    config, _ = finished
    (tmp_path / "empty").mkdir()
    for model_dir, message in ((tmp_path / "empty", f"no committed checkpoint in {tmp_path}/empty/checkpoints: "
                                "nothing to backfill"), (tmp_path / "nope", f"model dir not found: {tmp_path}/nope")):
        assert main(["evaluate", str(config), "--model-dir", str(model_dir), "--all"]) == 2
        assert capsys.readouterr().err.strip() == f"cadence: error: {message}"
    assert tree(tmp_path) == ["empty/"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
