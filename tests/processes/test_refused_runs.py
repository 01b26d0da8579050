"""A run refused by bad input leaves the model dir as it found it (issue 39, sections 2 to 4).

A fresh run refused before its first step (a ``train_step`` that returns no loss, a failed sanity
check) leaves no model dir; a resumed one (a bad ``train_step``, a model of another size) leaves
every file byte for byte and no lease file of its own; ``checkpoints`` a regular file is found
before anything is written; a refused two-rank job prints only cadence's line. Each exits 2 with one
line on stderr. The writer lease and the undo alone: tests/unit/test_footprint.py.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from cli_run import ENV, ROOT, run_python

DIGITS = ROOT / "examples" / "digits" / "config.yaml"
BEST = {"best_checkpoint": {"metric": "accuracy"}}  # best/ is created at the start too


def snapshot(model_dir: Path) -> dict[str, str]:
    """Every file (its SHA-256) and directory (``"dir"``) under ``model_dir``, by relative path."""
    return {str(p.relative_to(model_dir)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.rglob("*"))}


def refused(cadence, *args: str) -> str:
    """``cadence --log-level WARNING ARGS...`` exits 2 with one line on stderr: that line."""
    proc = cadence("--log-level", "WARNING", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cadence: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(("task", "params", "trainer", "expected"), [
    ("BadStepTask", {"returns": "text"}, {}, "BadStepTask.train_step must return a loss tensor or a dict with "
                                             "'loss', got str"),
    ("BadStepTask", {"returns": "none"}, BEST, "got NoneType"),
    ("BadStepTask", {"returns": "no_loss"}, {}, "got dict"),
    ("BadStepTask", {"returns": "vector"}, BEST, "returned a loss of shape (8,); expected a scalar tensor"),
    ("sanity_tasks.py:ListValidationTask", {}, {}, "ListValidationTask.validation_step returned a list of 2 item(s)"),
    ("sanity_tasks.py:EmptyValidationTask", {}, BEST, "BestCheckpointExporter: metric 'accuracy' is not in the "
                                                      "evaluation outputs; available: none (the output is empty)"),
], ids=["text", "none", "no-loss", "vector", "list-validation", "no-validation-batches"])
def test_a_fresh_run_refused_before_its_first_step_leaves_no_model_dir(tmp_path, cadence, write_config, task,
                                                                       params, trainer, expected):
    config = write_config(tmp_path, task, params=params, trainer=trainer)
    line = refused(cadence, "train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress")
    assert expected in line
    assert not (tmp_path / "run").exists()  # no config.yaml, checkpoints/, best/ or .writer/ lease


def test_a_model_dir_that_was_there_empty_stays_there_empty(tmp_path, cadence, write_config):
    (tmp_path / "run").mkdir()
    config = write_config(tmp_path, "BadStepTask", params={"returns": "none"}, trainer=BEST)
    refused(cadence, "train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress")
    assert snapshot(tmp_path / "run") == {}


def test_a_resumed_run_refused_keeps_every_file_as_it_was(tmp_path, cadence, write_config):
    """Its config.yaml (written over), FINAL (cleared to train past it), best.json and the older lease
    files (pruned by a lease taken) come back as they were, and its own lease file goes."""
    run = tmp_path / "run"
    for steps in (8, 16):  # two runs: two lease files, FINAL at 16
        cadence("train", str(write_config(tmp_path, trainer={**BEST, "train_steps": steps})), "--model-dir", str(run),
                "--no-progress", check=True)
    before = snapshot(run)
    assert {".writer/lease-000000000001.json", ".writer/lease-000000000002.json", "checkpoints/FINAL",
            "best/best.json", "config.yaml", "checkpoints/ckpt-16/MANIFEST.json"} <= set(before)
    config = write_config(tmp_path / "bad", "BadStepTask", params={"returns": "no_loss"},
                          trainer={**BEST, "train_steps": 24})
    assert "got dict" in refused(cadence, "train", str(config), "--model-dir", str(run), "--no-progress")
    assert snapshot(run) == before


def test_checkpoints_a_regular_file_is_one_line_before_anything_is_written(tmp_path, cadence, write_config):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory\n")
    line = refused(cadence, "train", str(write_config(tmp_path, trainer=BEST)), "--model-dir", str(run), "--no-progress")
    assert line == (f"cadence: error: {run / 'checkpoints'} is a file, not a directory: a training run writes its "
                    "checkpoints there; move it away or pick another model dir")
    assert snapshot(run) == {"checkpoints": hashlib.sha256(b"not a directory\n").hexdigest()}


def test_a_model_of_another_size_is_one_line_and_the_model_dir_stays_as_it_was(tmp_path, cadence, digits_run):
    """Resume (``train``) and ``evaluate`` with ``task.params.hidden`` other than the checkpoint's: one
    line naming the first tensor and both shapes, exit 2; the resume's lease file does not stay."""
    run = tmp_path / "run"
    shutil.copytree(digits_run[0], run)
    before = snapshot(run)
    expected = (f"cadence: error: {run}/checkpoints/ckpt-600/model.safetensors does not match the model "
                "(Sequential): '0.weight' has shape (128, 64) in the checkpoint, (32, 64) in the model (and 2 more "
                "tensors differ in shape)")
    for command in (("train", "--set", "trainer.train_steps=800", "--no-progress"), ("evaluate",)):
        assert refused(cadence, *command, str(DIGITS), "--model-dir", str(run), "--set", "task.params.hidden=32") == expected
        assert snapshot(run) == before, command


@pytest.mark.parametrize("case", ["bad-step", "batch-63"])
def test_a_refused_two_rank_job_prints_only_cadences_line_and_leaves_nothing(tmp_path, write_config, case):
    """Without OMP_NUM_THREADS (torch's launcher would print its banner): no line of torch's launcher
    (the banner, ``failed (exitcode: 2)``, stopping the other rank), and no model dir. Refused after the
    writer lease (a ``train_step`` with no loss, with best/, which both ranks create), or before it (the
    issue's case: a global batch of 63 on 2 ranks)."""
    if case == "bad-step":
        config, sets = write_config(tmp_path, "BadStepTask", params={"returns": "text"}, trainer=BEST), []
        expected = "cadence: error: BadStepTask.train_step must return a loss tensor or a dict with 'loss', got str"
    else:
        config, sets = DIGITS, ["--set", "task.params.global_batch_size=63"]
        expected = ("cadence: error: task.params.global_batch_size: 63 does not divide by the world size 2 "
                    "(processes): use a multiple of 2, e.g. 62 or 64")
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    proc = run_python(["-m", "cadence", "--log-level", "WARNING", "train", str(config), "--model-dir",
                       str(tmp_path / "run"), "--nproc", "2", "--no-progress", *sets], env=env, timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [expected], proc.stderr
    assert not (tmp_path / "run").exists()
