"""The Task of the goodput benchmark (``benchmarks/faults/goodput.py``), loaded by path by every rank:
a small MLP on synthetic data whose steps take ``step_time`` seconds (a sleep stands for the
compute, so that the two ranks do not fight over the machine's cores), which tells the benchmark
which processes run the current attempt and how many steps each attempt ran."""

from __future__ import annotations

import json
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
        self._fd = os.open(self._announce(ctx), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        return ResumableLoader(self.data, self.batch_size, seed=ctx.seed, rank=ctx.rank, world_size=ctx.world_size,
                               drop_last=True)

    def _announce(self, ctx) -> Path:
        """Write this worker's attempt file; the path of its steps file."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"attempt{attempt}-rank{ctx.rank}"
        _write(self.attempt_dir / name, str(os.getpid()))
        return self.attempt_dir / f"steps{name[7:]}"

    def _first_step_done(self) -> None:
        """Called once, when this worker's first train step has ended."""

    def train_step(self, model, batch):
        if self.steps == 1:
            self._first_step_done()
        time.sleep(self.step_time)
        self.steps += 1
        if self._fd is not None:
            os.pwrite(self._fd, f"{self.steps:>12}".encode(), 0)
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        return {"loss": F.cross_entropy(model(x), y)}


class NodeGoodputTask(GoodputTask):
    """GoodputTask for the two-node run (``benchmarks/faults/goodput_nodes.py``). A lost node's agent comes back with
    restart count 0, so each worker's files are named by its node and pid (``n<N>-p<P>``): ``worker-n<N>-p<P>.json``
    (``{"node", "rank", "pid", "started"}``, ``started``: the wall-clock time its process started) written when
    it builds its data, ``steps-n<N>-p<P>`` as GoodputTask's, and ``first-n<N>-p<P>``: the wall-clock time
    its first train step ended."""

    def _announce(self, ctx) -> Path:
        self._name = f"n{os.environ.get('CADENCE_NODE_RANK', '0')}-p{os.getpid()}"
        _write(self.attempt_dir / f"worker-{self._name}.json",
               json.dumps({"node": int(self._name[1:].split("-")[0]), "rank": ctx.rank, "pid": os.getpid(),
                           "started": _process_started()}))
        return self.attempt_dir / f"steps-{self._name}"

    def _first_step_done(self) -> None:
        _write(self.attempt_dir / f"first-{self._name}", repr(time.time()))


def _write(path: Path, text: str) -> None:
    """``text`` into ``path``, which a reader never sees half-written."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _process_started() -> float:
    """The wall-clock time this process started (``/proc/self/stat``'s start time, against ``/proc/uptime``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return time.time() - (float(Path("/proc/uptime").read_text().split()[0]) - started)
