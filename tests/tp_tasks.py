"""A tiny tensor-parallel Task for the device-mesh tests (``tests/tp_tasks.py:TPTask``): an 8-16-2 MLP
whose plan splits the first layer by columns and the second by rows over ``mesh["tp"]``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from cadence.torch import ResumableLoader, Task
from tasks import synthetic


class TPTask(Task):
    """``digest_dir``: each rank appends a digest of every training batch to ``digest_dir/rank<N>``
    (the tests compare what the ranks of a TP group and of the data-parallel dimensions read).
    ``tp_divisor``: what ``trainer.parallel.tp`` must divide (the hidden width splits over it)."""

    def __init__(self, global_batch_size: int = 8, n: int = 128, digest_dir: str | None = None,
                 tp_divisor: int = 16) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.digest_dir = digest_dir
        self.tp_divisor = tp_divisor
        self.train_set = synthetic(n, seed=1)
        self.val_set = synthetic(32, seed=2)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def parallelize(self, model: nn.Module, tp_mesh) -> nn.Module:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def build_inputs(self, split, ctx):
        if split == "train":
            batch = ctx.per_rank_batch(self.global_batch_size, name="task.params.global_batch_size")
            return ResumableLoader(self.train_set, batch, seed=ctx.seed, rank=ctx.dp_rank, world_size=ctx.dp_size,
                                   drop_last=True)
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=8)

    def train_step(self, model, batch):
        x, y = batch
        if self.digest_dir is not None:
            digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
            with open(Path(self.digest_dir, f"rank{os.environ.get('RANK', '0')}"), "a") as f:
                f.write(digest + "\n")
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}
