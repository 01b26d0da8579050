"""The Task of the goodput benchmark (``benchmarks/goodput.py``), loaded by path by every rank:
a small MLP on synthetic data whose steps take ``step_time`` seconds (a sleep stands for the
compute, so that the two ranks do not fight over the machine's cores), which tells the benchmark
which processes run the current attempt and how many steps each attempt ran."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from cadence.torch import ResumableLoader, Task


class GoodputTask(Task):
    """``attempt_dir``: rank R of attempt A (torchrun's restart count) writes its pid to
    ``attempt<A>-rank<R>`` when it builds its data, and the number of train steps it has run in
    ``steps<A>-rank<R>`` (rewritten in place at every step)."""

    def __init__(self, attempt_dir: str, step_time: float = 0.05, n: int = 65536, batch_size: int = 32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 32, generator=g)
        self.data = TensorDataset(x, (x[:, :8].sum(dim=1) > 0).long())
        self.attempt_dir = Path(attempt_dir)
        self.step_time = step_time
        self.batch_size = batch_size
        self.steps = 0
        self._fd: int | None = None

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 2))

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def build_inputs(self, split, ctx):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"attempt{attempt}-rank{ctx.rank}"
        self._fd = os.open(self.attempt_dir / f"steps{name[7:]}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        tmp = self.attempt_dir / f"{name}.tmp"
        tmp.write_text(str(os.getpid()))
        tmp.replace(self.attempt_dir / name)
        return ResumableLoader(self.data, self.batch_size, seed=ctx.seed, rank=ctx.rank, world_size=ctx.world_size,
                               drop_last=True)

    def train_step(self, model, batch):
        time.sleep(self.step_time)
        self.steps += 1
        if self._fd is not None:
            os.pwrite(self._fd, f"{self.steps:>12}".encode(), 0)
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        return {"loss": F.cross_entropy(model(x), y)}
