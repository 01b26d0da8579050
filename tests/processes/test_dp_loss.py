"""The logged training ``loss`` under several ranks is the mean over the data-parallel ranks of
what each computed (not rank 0's own): a 2-rank DDP run whose ranks see different data."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence

HERE = Path(__file__).parents[1]
sys.path.insert(0, str(HERE))


def test_the_logged_loss_is_the_mean_over_the_ranks_of_each_ranks_loop_mean(tmp_path):
    losses = tmp_path / "losses"
    losses.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"class": f"{HERE / 'ac_tasks.py'}:LossRecordingTask", "params": {"n": 128, "loss_dir": str(losses)}},
        "trainer": {"train_steps": 8, "steps_per_loop": 4, "checkpoint_interval": None, "validation_interval": None,
                    "seed": 1, "strategy": "ddp"}}))
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress", "--nproc", "2",
                       timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [[float(v) for v in (losses / f"rank{r}.txt").read_text().split()] for r in (0, 1)]
    assert [len(v) for v in per_rank] == [8, 8]
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "train") if "loss" in r}
    assert sorted(logged) == [4, 8]
    for loop, step in enumerate((4, 8)):
        # Each rank's loop mean in float32 as the trainer computes it, then their mean.
        own = [torch.tensor(v[4 * loop:4 * loop + 4], dtype=torch.float32).sum() / 4 for v in per_rank]
        expected = float((own[0] + own[1]) / 2)
        assert abs(logged[step] - expected) <= 1e-6 * abs(expected), (step, logged[step], expected)
        assert abs(logged[step] - float(own[0])) > 1e-4, "the logged loss is rank 0's own"
