"""NaN recovery through ``cadence train``: a poisoned training sample gives a NaN loss at a known
step; the run rolls back to the last checkpoint, skips the offending batches, logs the skipped
range and finishes -- or, with ``max_trials=0``, fails with a clear error."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli_run import run_cadence
from configs import write_config

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"


def train(tmp_path: Path, max_trials: int) -> tuple[subprocess.CompletedProcess, Path]:
    # 200 samples in batches of 8, not shuffled: sample 100 is in batch 12 (0-based), i.e. step 13,
    # in the loop of steps 11-15. The checkpoint before it is at step 10.
    config = write_config(tmp_path, TASK, params={"poison_index": 100}, trainer={
        "train_steps": 20, "steps_per_loop": 5, "checkpoint_interval": 5, "validation_interval": 10,
        "max_to_keep": None, "seed": 0, "recovery": {"max_trials": max_trials}})
    model_dir = tmp_path / "run"
    proc = run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress", env={"COLUMNS": "200"})
    return proc, model_dir


def test_nan_loss_rolls_back_skips_the_batches_and_finishes(tmp_path):
    proc, model_dir = train(tmp_path, max_trials=2)
    assert proc.returncode == 0, proc.stderr
    assert "rolled back to the checkpoint at step 10" in proc.stderr
    assert "the batches of steps 11-15 are skipped" in proc.stderr

    ckpts = model_dir / "checkpoints"
    assert json.loads((ckpts / "FINAL").read_text())["step"] == 20
    for step in (15, 20):  # checkpoints after the recovery hold finite weights
        weights = load_file(ckpts / f"ckpt-{step}" / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values())
    state = json.loads((ckpts / "ckpt-20" / "state.json").read_text())["state"]
    assert state["train_actions/0/recovery"] == {"trials": 1, "skipped": [[11, 15]]}
    # the data kept moving: 20 optimizer steps, but 25 batches (one whole epoch) consumed
    assert state["trainer"]["data"]["state"] == {"epoch": 1, "offset": 0}
    train_rows = [json.loads(line) for line in (model_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 15, 20]  # step 15 trained twice
    assert train_rows[2]["loss"] != train_rows[2]["loss"]  # the NaN loop was logged as NaN


def test_max_trials_zero_fails_with_a_clear_error(tmp_path):
    proc, model_dir = train(tmp_path, max_trials=0)
    assert proc.returncode == 1
    assert "loss nan at step 15 after 0 recoveries (max_trials=0)" in proc.stderr
    assert "Traceback" not in proc.stderr
    # what was saved before the divergence is intact and there is no NaN checkpoint
    ckpts = model_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-10", "ckpt-5"]
    assert not (ckpts / "FINAL").exists()
