"""Training and evaluation on a device mesh give the numbers of a run without tensor parallelism
(issue 41, item 5), on gloo CPU processes.

One 4-rank job (dp_shard 2 x tp 2) of a Task with dropout on replicated activations, gradient
clipping that clips on every step (the gradients live on two meshes: ``(dp_shard, tp)`` for the TP
layers, ``dp_shard`` for the others), two micro-batches per step, a ``Sum`` and a ``Concat`` metric
and an ``aggregate_logs`` state, against the same config on 2 ranks (dp_shard 2, no TP). The
reference keeps the data-parallel layout, not one process: each data-parallel rank draws its own
dropout masks for its half of the batch, which one process drawing one mask for the whole batch
cannot reproduce. Measured (torch 2.13, CPU): the losses agree within 1e-7 relative and the weights
within 2e-7 of their largest entry (the all-reduces and the norm add in another order); the
tolerance is 1e-5. The in-process validation equals ``cadence evaluate`` of the same checkpoint on
one process: exactly for the counts, 1e-6 for means. Then TP alone (2 ranks) in bf16 with dropout,
stopped and resumed: bit-identical.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from cadence.summaries.metrics_file import read_metrics
from cli_run import checkpoint_weights, run_cadence, same_weights
from configs import write_config

cadence = partial(run_cadence, env={"COLUMNS": "200"})
TASK = "tp_metric_tasks.py:MeshMetricTask"
VAL_SAMPLES = 32  # the task's validation set
TOL = 1e-5
TRAINER = {"train_steps": 8, "steps_per_loop": 2, "checkpoint_interval": 8, "validation_interval": 8,
           "grad_accum_steps": 2, "grad_clip_norm": 0.5}  # the gradient norm is 1.5-3: every step clips


def train(tmp: Path, name: str, nproc: int, parallel: dict[str, int], **trainer: object) -> Path:
    """Run the task on ``nproc`` ranks with ``parallel``; its directory (``run/``, ``rng/``, ``config.yaml``)."""
    home = tmp / name
    (home / "rng").mkdir(parents=True)
    config = write_config(home, TASK, params={"rng_dir": str(home / "rng")},
                          trainer={**TRAINER, "parallel": parallel, **trainer})
    proc = cadence("train", str(config), "--model-dir", str(home / "run"), "--nproc", str(nproc), "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return home


def losses(home: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(home / "run" / "train") if "loss" in r}


def rng_digests(home: Path, nproc: int) -> list[list[str]]:
    return [(home / "rng" / f"rank{r}").read_text().split() for r in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("mesh-training")
    return train(tmp, "mesh", 4, {"dp_shard": 2, "tp": 2}), train(tmp, "ref", 2, {"dp_shard": 2})


def test_the_ranks_of_a_tp_group_draw_the_same_random_numbers(runs):
    mesh, ref = runs
    ranks = rng_digests(mesh, 4)
    assert all(len(r) == 16 for r in ranks)  # 8 steps of 2 micro-batches
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]  # ranks 0-1 and 2-3 are the TP groups
    assert not set(ranks[0]) & set(ranks[2])  # the data-parallel ranks draw their own
    assert [ranks[0], ranks[2]] == rng_digests(ref, 2)  # each data-parallel rank's stream, as without TP


def test_the_loss_curve_and_the_weights_are_those_of_the_run_without_tp(runs):
    mesh, ref = runs
    got, want = losses(mesh), losses(ref)
    assert sorted(got) == sorted(want) == [2, 4, 6, 8]
    assert all(abs(got[s] - want[s]) <= TOL * abs(want[s]) for s in want), (got, want)
    a, b = checkpoint_weights(mesh / "run" / "checkpoints" / "ckpt-8"), checkpoint_weights(ref / "run" / "checkpoints" / "ckpt-8")
    assert a.keys() == b.keys() and any(k.startswith("4.") for k in a)  # the LayerNorm, outside the TP plan
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=TOL, atol=TOL * float(b[k].abs().max())), k


def test_the_validation_counts_each_sample_once_and_equals_cadence_evaluate_on_one_process(runs):
    mesh, ref = runs
    [in_process] = [r for r in read_metrics(mesh / "run" / "eval") if r["step"] == 8]
    [reference] = [r for r in read_metrics(ref / "run" / "eval") if r["step"] == 8]
    assert in_process["samples"] == in_process["aggregated_samples"] == VAL_SAMPLES  # each TP group's batches once
    assert in_process["correct"] == int(in_process["correct"]) == reference["correct"]  # the Sum, not doubled
    proc = cadence("evaluate", str(mesh / "config.yaml"), "--model-dir", str(mesh / "run"), "--checkpoint", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = json.loads(proc.stdout)
    assert alone["step"] == 8
    for key in ("samples", "aggregated_samples", "correct"):
        assert alone[key] == in_process[key], key
    for key in ("loss", "accuracy"):
        assert in_process[key] == pytest.approx(alone[key], rel=1e-6), key


def test_tensor_parallel_training_in_bf16_resumes_exactly(tmp_path):
    """tp 2 alone (no FSDP: the gradient norm is over DTensors and plain tensors), bf16 autocast,
    dropout: a run stopped at its checkpoint and resumed ends bit-identical to one that was not."""
    bf16 = {"precision": "bf16", "train_steps": 4, "checkpoint_interval": 2, "validation_interval": 4}
    home = train(tmp_path, "bf16", 2, {"tp": 2}, **bf16)
    logged = losses(home)
    assert sorted(logged) == [2, 4] and all(math.isfinite(v) for v in logged.values())
    ranks = rng_digests(home, 2)
    assert len(ranks[0]) == 8 and ranks[0] == ranks[1]
    [evaluated] = read_metrics(home / "run" / "eval")
    assert evaluated["samples"] == VAL_SAMPLES and math.isfinite(evaluated["loss"])
    weights = checkpoint_weights(home / "run" / "checkpoints" / "ckpt-4")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())
    stopped = train(tmp_path, "stopped", 2, {"tp": 2}, **{**bf16, "train_steps": 2})
    proc = cadence("train", str(stopped / "config.yaml"), "--model-dir", str(stopped / "run"), "--nproc", "2",
                   "--no-progress", "--set", "trainer.train_steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert rng_digests(stopped, 2) == ranks  # the resumed ranks draw on from their saved streams
    assert same_weights(checkpoint_weights(stopped / "run" / "checkpoints" / "ckpt-4"), weights)
