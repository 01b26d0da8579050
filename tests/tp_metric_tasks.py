"""A tensor-parallel Task for the metric, clipping and RNG tests on a device mesh
(``tests/tp_metric_tasks.py:MeshMetricTask``).

An MLP with dropout on replicated activations (its input and after a LayerNorm): ``1`` is split by
columns and ``3`` by rows over ``mesh["tp"]``; the LayerNorm and the head stay outside the plan, so
under FSDP their parameters live on the data-parallel mesh and the others on ``(dp_shard, tp)`` (a
gradient norm over two meshes). SGD, so that clipping changes the update. Its metrics: a weighted
mean (``loss``, ``accuracy``), a :class:`~cadence.metrics.Sum` of correct predictions and a
:class:`~cadence.metrics.Concat` of the labels that counts the samples evaluated, and an
``aggregate_logs`` state that counts them too (``aggregated_samples``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cadence.metrics import Concat, Sum
from tp_tasks import TPTask


class MeshMetricTask(TPTask):
    """``rng_dir``: each rank appends a digest of its torch RNG state, at every training batch, to
    ``rng_dir/rank<N>`` (the ranks of a TP group must draw the same numbers)."""

    def __init__(self, global_batch_size: int = 8, n: int = 128, dropout: float = 0.2, lr: float = 0.2,
                 rng_dir: str | None = None) -> None:
        super().__init__(global_batch_size=global_batch_size, n=n, tp_divisor=16)
        self.dropout, self.lr, self.rng_dir = dropout, lr, rng_dir

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Dropout(self.dropout), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8),
                             nn.LayerNorm(8), nn.Dropout(self.dropout), nn.Linear(8, 2))

    def parallelize(self, model: nn.Module, tp_mesh) -> nn.Module:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(model, tp_mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.5)

    def train_step(self, model, batch):
        if self.rng_dir is not None:
            digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
            with open(Path(self.rng_dir, f"rank{os.environ.get('RANK', '0')}"), "a") as f:
                f.write(digest + "\n")
        x, y = batch
        return F.cross_entropy(model(x), y)

    def build_metrics(self):
        return {"correct": Sum(), "samples": Concat(fn=lambda labels: len(labels))}

    def aggregate_logs(self, state, step_outputs):
        return (state or 0) + len(step_outputs["samples"])

    def merge_aggregated_logs(self, states):
        return sum(states)

    def reduce_aggregated_logs(self, aggregated_logs, global_step):
        return {"aggregated_samples": aggregated_logs}

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        right = logits.argmax(1) == y
        return {"loss": F.cross_entropy(logits, y), "accuracy": right.float().mean(),
                "correct": right.sum(), "samples": y}
