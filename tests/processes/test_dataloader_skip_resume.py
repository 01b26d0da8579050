"""A plain shuffled ``DataLoader`` resumed from the CLI skips the batches its checkpoint had consumed
without loading them (issue 40, item 8): stopped cleanly, or killed with SIGKILL, mid-epoch in its
second epoch (batch 3 of 10: with 2 workers, a batch the second worker loads), its samples randomly
augmented from the loading process's torch, numpy and ``random`` RNGs (a worker's, with workers),
the resumed run ends with the uninterrupted run's weights, bit for bit, and logs no replay. On 2
ranks over a ``DistributedSampler``, each rank saves its own workers' RNG states and resumes them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_run import checkpoint_weights, killed_after, run_cadence, same_weights
from configs import write_config

STEPS, STOP = 25, 13  # 10 batches an epoch: step 13 is batch 3 of epoch 1
TRAINER = {"train_steps": STEPS, "steps_per_loop": 1, "checkpoint_interval": STOP, "validation_interval": None,
           "sanity_val_steps": 0}


def config(tmp_path: Path, workers: int, **params: object) -> Path:
    return write_config(tmp_path, "epoch_tasks.py:PlainLoaderTask",
                        params={"n": 80, "num_workers": workers, "augment": True, **params}, trainer=TRAINER)


def train(cfg: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = run_cadence("train", str(cfg), "--model-dir", str(run), "--no-progress", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_shuffled_dataloader_resumes_without_replaying_bit_identical(tmp_path, how, workers):
    cfg = config(tmp_path, workers)
    train(cfg, tmp_path / "straight")
    run = tmp_path / "run"
    if how == "stopped":
        train(cfg, run, "--set", f"trainer.train_steps={STOP}")
    else:
        killed_after(cfg, run, STOP, STEPS)
    position = json.loads((run / "checkpoints" / f"ckpt-{STOP}" / "state.json").read_text())["state"]["trainer"]
    assert position["data"]["kind"] == "replay" and position["data"]["batches"] == 3
    assert position["data"]["epoch"] == 1
    # With workers: the RNG states of both, each after the last of its 3 batches consumed.
    assert set(position["data"].get("workers_rng", {})) == ({"0", "1"} if workers else set())
    resumed = train(cfg, run)
    log = " ".join(resumed.stderr.split())  # rich wraps lines
    assert "restored checkpoint" in log
    assert "resuming the train data at batch 3 without loading the skipped samples" in log
    assert "replaying" not in log
    final = f"ckpt-{STEPS}"
    assert same_weights(checkpoint_weights(run / "checkpoints" / final),
                        checkpoint_weights(tmp_path / "straight" / "checkpoints" / final))


def test_on_two_ranks_each_resumes_its_own_workers_rng_bit_identical(tmp_path):
    """5 batches an epoch on each rank: step 13 is batch 3 of epoch 2."""
    cfg, ranks = config(tmp_path, 2, sampler=True), ("--nproc", "2")
    train(cfg, tmp_path / "straight", *ranks)
    run = tmp_path / "run"
    killed_after(cfg, run, STOP, STEPS, *ranks)
    position = json.loads((run / "checkpoints" / f"ckpt-{STOP}" / "state.json").read_text())["state"]["trainer"]
    saved = position["rank_data"]  # the ranks' workers draw from different seeds
    assert len(saved) == 2 and saved[0]["workers_rng"] != saved[1]["workers_rng"]
    assert all(p["batches"] == 3 and p["epoch"] == 2 and set(p["workers_rng"]) == {"0", "1"} for p in saved)
    resumed = train(cfg, run, *ranks)
    assert "replaying" not in " ".join(resumed.stderr.split())
    final = f"ckpt-{STEPS}"
    assert same_weights(checkpoint_weights(run / "checkpoints" / final),
                        checkpoint_weights(tmp_path / "straight" / "checkpoints" / final))
