"""Epochs as a unit from the CLI (issue 40, items 5-7), over a plain ``DataLoader`` of 10 batches per
epoch: an LR scheduler stepped per epoch halves the rate at each epoch's end, and a run killed -9
(after a checkpoint at an epoch's end, or in the middle of one) resumes bit-identically, weights,
optimizer and scheduler state and every logged loss and rate; ``checkpoint_interval: 1ep`` and
``validation_interval: 2ep`` checkpoint and validate at the epochs' ends, and the progress line shows
the total of ``max_epochs``; an interval in epochs over train data without a length is one line,
exit 2, before the model dir is created."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_run import checkpoint_weights, killed_after, run_cadence, same_weights
from configs import write_config

STEPS, LR = 25, 1e-2  # 10 batches per epoch (80 samples, batches of 8): epochs end at steps 10 and 20
TRAINER = {"train_steps": STEPS, "steps_per_loop": 4, "validation_interval": None, "sanity_val_steps": 0}


def train(cfg: Path, run: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_cadence("train", str(cfg), "--model-dir", str(run), *extra)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def logged(run: Path, split: str = "train") -> list[dict]:
    return [json.loads(line) for line in (run / split / "metrics.jsonl").read_text().splitlines()]


def optimizer_state(checkpoint: Path) -> tuple[dict, dict]:
    """The optimizer, scheduler and scaler state of a checkpoint: its tensors and its JSON structure."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = checkpoint / "optimizer.safetensors"
    with safe_open(str(path), "pt") as f:
        return load_file(path), dict(f.metadata())


@pytest.mark.parametrize("interval, killed_at", [("1ep", 10), (8, 16)], ids=["at-an-epochs-end", "mid-epoch"])
def test_an_epoch_scheduler_halves_the_rate_per_epoch_and_resumes_bit_identical(tmp_path, interval, killed_at):
    cfg = write_config(tmp_path, "epoch_tasks.py:EpochLRTask", params={"n": 80},
                       trainer={**TRAINER, "checkpoint_interval": interval})
    straight = tmp_path / "straight"
    train(cfg, straight, "--no-progress")
    rows = logged(straight)
    # the rate each loop's last step trained at: halved once per epoch (StepLR(step_size=1)), not per step
    assert [(r["step"], r["learning_rate"]) for r in rows] == [(r["step"], LR * 0.5 ** ((r["step"] - 1) // 10)) for r in rows]
    assert {r["learning_rate"] for r in rows} == {LR, LR / 2, LR / 4} and rows[-1]["step"] == STEPS
    run = tmp_path / "run"
    killed_after(cfg, run, killed_at, STEPS)
    resumed = train(cfg, run, "--no-progress")
    assert "restored checkpoint" in resumed.stderr
    final = f"ckpt-{STEPS}"
    assert same_weights(checkpoint_weights(run / "checkpoints" / final),
                        checkpoint_weights(straight / "checkpoints" / final))
    (tensors, structure), (tensors0, structure0) = (optimizer_state(d / "checkpoints" / final) for d in (run, straight))
    assert same_weights(tensors, tensors0) and structure == structure0  # Adam's moments, the scheduler's epoch count
    assert [(r["step"], r["loss"], r["learning_rate"]) for r in logged(run)] == \
        [(r["step"], r["loss"], r["learning_rate"]) for r in rows]


def test_intervals_in_epochs_checkpoint_and_validate_at_the_epochs_ends_with_a_total(tmp_path):
    cfg = write_config(tmp_path, "epoch_tasks.py:PlainLoaderTask", params={"n": 80},
                       trainer={**TRAINER, "train_steps": None, "max_epochs": 3, "checkpoint_interval": "1ep",
                                "validation_interval": "2ep"})
    run = tmp_path / "run"
    proc = train(cfg, run)  # loops of 4 steps, cut at the epochs' ends (10, 20, 30)
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*")) == ["ckpt-10", "ckpt-20", "ckpt-30"]
    assert [r["step"] for r in logged(run, "eval")] == [20, 30]  # every 2 epochs, and at the end
    assert [r["step"] for r in logged(run)] == [4, 8, 10, 14, 18, 20, 24, 28, 30]
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 30
    assert "step 30/30 (100%)" in proc.stderr  # the progress line knows max_epochs' total (not "step 30")


def test_an_interval_in_epochs_without_a_length_is_one_line_before_the_model_dir_is_created(tmp_path):
    cfg = write_config(tmp_path, "epoch_tasks.py:UnsizedTask", params={"n": 80}, trainer=TRAINER)
    run = tmp_path / "run"
    proc = train(cfg, run, "--no-progress", "--set", "trainer.validation_interval=2ep", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "trainer.validation_interval is '2ep' (in epochs), but the train data has no length" in proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()
