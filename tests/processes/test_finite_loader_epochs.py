"""Epochs over finite train loaders from the CLI (issue 27, item 6): a plain ``DataLoader`` (shuffled from
the global RNG; over a ``DistributedSampler`` on 2 ranks) and torchdata's ``StatefulDataLoader`` with 2
workers train for several epochs (10 batches each on one rank), and a run killed -9 after a checkpoint
in its second epoch resumes bit-identically across the next epoch boundary; ``trainer.max_epochs``
ends a run with ``train_steps: null``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_run import checkpoint_weights, killed_after, run_cadence, same_weights
from configs import write_config

STEPS = 25  # 10 batches per epoch on one rank, 5 on each of 2: epoch boundaries at 10, 20 (and 5, 15, 25)
TRAINER = {"train_steps": STEPS, "checkpoint_interval": 8, "validation_interval": None, "sanity_val_steps": 0}
KINDS = {  # task, params, extra CLI arguments
    "dataloader": ("epoch_tasks.py:PlainLoaderTask", {"n": 80}, ()),
    "stateful-2-workers": ("StatefulLoaderTask", {"n": 80, "num_workers": 2}, ()),
    "sampler-2-ranks": ("epoch_tasks.py:PlainLoaderTask", {"n": 80, "sampler": True}, ("--nproc", "2")),
}


def train(cfg: Path, run: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_cadence("train", str(cfg), "--model-dir", str(run), "--no-progress", *extra)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("kind", list(KINDS))
def test_killed_in_a_later_epoch_resumes_bit_identical(tmp_path, kind):
    task, params, extra = KINDS[kind]
    cfg = write_config(tmp_path, task, params=params, trainer=TRAINER)
    train(cfg, tmp_path / "straight", *extra)
    run = tmp_path / "run"
    killed_after(cfg, run, 16, STEPS, *extra)  # one rank: epoch 1, 6 batches in (2 ranks: epoch 3, 1 in)
    position = json.loads((run / "checkpoints" / "ckpt-16" / "state.json").read_text())["state"]["trainer"]
    saved = position["rank_data"] if "rank_data" in position else [position["data"]]
    assert all(p["epoch"] == (3 if extra else 1) for p in saved)
    assert all(("rng" in p) == (p["kind"] == "replay") for p in saved)  # a replayed epoch's RNG at its start
    resumed = train(cfg, run, *extra)
    assert "restored checkpoint" in resumed.stderr
    final = f"ckpt-{STEPS}"
    assert same_weights(checkpoint_weights(run / "checkpoints" / final),
                        checkpoint_weights(tmp_path / "straight" / "checkpoints" / final))
    logged = [json.loads(line) for line in (tmp_path / "straight" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == STEPS and logged[-1]["epoch"] == (4 if extra else 2)


def test_max_epochs_ends_a_run_without_train_steps_and_neither_is_one_line(tmp_path):
    cfg = write_config(tmp_path, "epoch_tasks.py:PlainLoaderTask", params={"n": 80},
                       trainer={**TRAINER, "train_steps": None, "max_epochs": 2, "steps_per_loop": 3})
    train(cfg, tmp_path / "run")
    final = json.loads((tmp_path / "run" / "checkpoints" / "FINAL").read_text())
    assert final["step"] == 20 and (tmp_path / "run" / "checkpoints" / "ckpt-20" / "MANIFEST.json").exists()
    neither = train(cfg, tmp_path / "endless", "--set", "trainer.max_epochs=null", check=False)
    assert neither.returncode == 2 and "Traceback" not in neither.stderr
    assert "trainer.train_steps and trainer.max_epochs are both null" in " ".join(neither.stderr.split())
