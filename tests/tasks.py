"""Small Tasks used by the end-to-end tests (loaded by path: ``tests/tasks.py:TinyTask``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence.torch import ResumableLoader, Task


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(x, y)


class ModelOnlyTask(Task):
    """A Task that builds ``model()`` and ``optimizer(parameters)`` and nothing else: for in-process
    checkpoint tests that build a ``TorchTrainer`` and never run its loop (no data, no steps)."""

    def __init__(self, model, optimizer) -> None:
        self._model, self._optimizer = model, optimizer

    def build_model(self) -> nn.Module:
        return self._model()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self._optimizer(model.parameters())

    def build_inputs(self, split, ctx):
        return []

    def train_step(self, model, batch):
        raise NotImplementedError

    def validation_step(self, model, batch):
        raise NotImplementedError


class TinyTask(Task):
    """An 8-16-2 MLP with dropout (so RNG state matters) on a shuffled, resumable loader.

    ``step_sleep`` slows each step down so a test can kill the process mid-run.
    ``hold_file``: while that file exists, each step waits (a test holds a run mid-way, then lets it go).
    ``eval_sleep`` slows each validation batch down (a slow sidecar).
    ``pid_dir`` gets a file ``rank<N>`` with each process's pid (``group<R>`` for a fault-tolerant replica
    group's, ``group<R>rank<N>`` for a rank of a group of several); ``restart_sleep``: a process that
    finds its file there already (a restarted one) first sleeps that long, as a restart on a cluster
    takes a while.
    ``start_together``: at its first validation batch (the sanity check's, just before training), each
    process marks itself ready in ``pid_dir`` and waits until that many have (fault-tolerant replica
    groups then ask for their first quorum together: each group's rank 0 reached the lighthouse before).
    A restarted process finds its mark and does not wait.
    ``poison_index`` puts a NaN into that training sample (and turns shuffling off, so the step
    that meets it is known): its batch gives a NaN loss.
    ``hidden`` is the width of the hidden layer (a bigger checkpoint), ``outputs`` that of the head (the
    labels are 0 and 1): 64 and 10 make the head's weight gradient a product whose float result depends
    on the number of CPU threads.
    ``position_dir``: each train step appends its train loader's position after its batch (``epoch offset``)
    to ``position_dir/group<R>.<pid>`` (``rank<N>.<pid>``): what the process really drew.
    """

    def __init__(self, step_sleep: float = 0.0, batch_size: int = 8, n: int = 200,
                 poison_index: int | None = None, eval_sleep: float = 0.0, pid_dir: str | None = None,
                 hidden: int = 16, hold_file: str | None = None, outputs: int = 2, restart_sleep: float = 0.0,
                 position_dir: str | None = None, start_together: int = 0) -> None:
        super().__init__()
        self.pid_dir, self.start_together, self.name = pid_dir, start_together, "rank0"
        self.position_file = None
        if position_dir is not None:
            group = os.environ.get("CADENCE_REPLICA_ID")
            name = f"group{group}" if group is not None else f"rank{os.environ.get('RANK', '0')}"
            self.position_file = Path(position_dir, f"{name}.{os.getpid()}")
        self.train_loader = None
        self.hidden = hidden
        self.outputs = outputs
        if pid_dir is not None:  # lets a test signal one rank of a multi-process job
            group = os.environ.get("CADENCE_REPLICA_ID")  # a fault-tolerant replica group's process
            rank = f"rank{os.environ.get('RANK', '0')}"
            several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a group of several ranks: group<R>rank<N>
            name = rank if group is None else f"group{group}{rank if several else ''}"
            if restart_sleep and Path(pid_dir, name).exists():
                time.sleep(restart_sleep)
            Path(pid_dir, name).write_text(str(os.getpid()))
            self.name = name
        self.step_sleep = step_sleep
        self.hold_file = hold_file
        self.eval_sleep = eval_sleep
        self.batch_size = batch_size
        self.train_set = synthetic(n, seed=1)
        self.val_set = synthetic(64, seed=2)
        self.shuffle = poison_index is None
        if poison_index is not None:
            self.train_set.tensors[0][poison_index] = float("nan")

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, self.hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(self.hidden, self.outputs))

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def _start_together(self):
        marker = Path(self.pid_dir, f"ready-{self.name}")
        if not marker.exists():  # the process's first validation batch (its last before training)
            marker.touch()
            deadline = time.monotonic() + 120
            while len(list(Path(self.pid_dir).glob("ready-*"))) < self.start_together and time.monotonic() < deadline:
                time.sleep(0.02)

    def build_lr_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)

    def build_inputs(self, split, ctx):
        if split == "train":
            # fault-tolerant replica groups split the data over all of them (ctx.data_shard)
            rank, world = (ctx.data_shard() if ctx.replica_groups > 1 else (ctx.rank, ctx.world_size))
            self.train_loader = ResumableLoader(self.train_set, self.batch_size, shuffle=self.shuffle, seed=ctx.seed,
                                                rank=rank, world_size=world, drop_last=world > 1)
            return self.train_loader
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=16)

    def example_inputs(self):
        return (self.val_set.tensors[0][:4],)

    def train_step(self, model, batch):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        while self.hold_file is not None and os.path.exists(self.hold_file):
            time.sleep(0.01)
        if self.position_file is not None and self.train_loader is not None:
            with open(self.position_file, "a") as out:
                out.write("{epoch} {offset}\n".format(**self.train_loader.state_dict()))
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        if self.start_together and self.pid_dir is not None:
            self._start_together()
        if self.eval_sleep:
            time.sleep(self.eval_sleep)
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


class SlowStagingTask(TinyTask):
    """TinyTask whose asynchronous saves copy slowly: in the process that builds it, every pipelined
    snapshot's copy (a sharded write's staging, and each tensor's copy of a file checkpoint) first
    waits ``staging_delay`` seconds, so that training reaches its next optimizer step with the copy in
    flight."""

    def __init__(self, staging_delay: float = 0.3, **kwargs) -> None:
        super().__init__(**kwargs)
        from cadence.torch.checkpoint_io import pipelined, shard_writes

        stage, copy = shard_writes.ShardWrites._stage, pipelined.copy_tensor

        def slow_stage(self, state):
            time.sleep(staging_delay)
            return stage(self, state)

        def slow_copy(t, into=None):
            time.sleep(staging_delay / 10)
            return copy(t, into)

        shard_writes.ShardWrites._stage = slow_stage
        pipelined.copy_tensor = slow_copy


class NoExampleTask(TinyTask):
    """TinyTask without example inputs (the Task default raises NotImplementedError)."""

    def example_inputs(self):
        return Task.example_inputs(self)


class DataDirTask(TinyTask):
    """TinyTask whose validation inputs are scaled by the number in ``data_dir/scale.txt``, read when it
    is built and again when its validation input is: a relative ``data_dir`` (the hf_gpt2 example's) works
    only where the run's relative paths mean what they said (issue 40)."""

    def __init__(self, data_dir: str = "data", **kwargs) -> None:
        super().__init__(**kwargs)
        self.data_dir = Path(data_dir)
        if not (self.data_dir / "scale.txt").is_file():
            from cadence.errors import ConfigError

            raise ConfigError(f"task.params.data_dir: no scale.txt in {self.data_dir} (from {os.getcwd()})")

    def build_inputs(self, split, ctx):
        if split == "train":
            return super().build_inputs(split, ctx)
        scale = float((self.data_dir / "scale.txt").read_text())
        x, y = self.val_set.tensors
        return DataLoader(ctx.wrap_dataset(TensorDataset(x * scale, y)), batch_size=16)


class NotAModelTask(TinyTask):
    """``build_model`` returns ``model`` (``None`` by default, or any value) instead of an ``nn.Module``."""

    def __init__(self, model=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def build_model(self):
        return self.model


class BadLossTask(TinyTask):
    """``train_step`` returns the per-sample losses (not reduced), or with ``as_float`` a Python float."""

    def __init__(self, as_float: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.as_float = as_float

    def train_step(self, model, batch):
        x, y = batch
        losses = F.cross_entropy(model(x), y, reduction="none")
        return losses.mean().item() if self.as_float else losses


class BadStepTask(TinyTask):
    """``train_step`` returns what ``returns`` names instead of a loss: ``"text"`` (a string), ``"none"``,
    ``"no_loss"`` (a dict of logs without ``loss``) or ``"vector"`` (the per-sample losses)."""

    def __init__(self, returns: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        self.returns = returns

    def train_step(self, model, batch):
        x, y = batch
        losses = F.cross_entropy(model(x), y, reduction="none")
        return {"text": "loss", "none": None, "no_loss": {"accuracy": losses.detach().mean()},
                "vector": losses}[self.returns]


class BatchNormTask(TinyTask):
    """TinyTask with BatchNorm: on several ranks each rank's running statistics follow its own share of
    the batch, so the ranks' copies differ after a step. Validation batches hold one sample each, so that
    the metrics over unpadded shards on any number of ranks add up the very per-sample numbers one process
    does (float64 sums of float32 losses: exact), and only the weights can make them differ."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, self.hidden), nn.BatchNorm1d(self.hidden), nn.ReLU(),
                             nn.Linear(self.hidden, self.outputs))

    def build_inputs(self, split, ctx):
        if split == "train":
            return super().build_inputs(split, ctx)
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=1)


class NoSchedulerTask(TinyTask):
    """TinyTask without an LR scheduler of its own (for ``trainer.lr_schedule``)."""

    def build_lr_scheduler(self, optimizer):
        return None


class StatefulLoaderTask(TinyTask):
    """TinyTask on torchdata's ``StatefulDataLoader`` with worker processes: each rank its shard
    through a ``StatefulDistributedSampler``, shuffled, and a random augmentation drawn in the
    workers from a generator the (Stateful) dataset owns."""

    def __init__(self, num_workers: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_workers = num_workers

    def build_inputs(self, split, ctx):
        if split != "train":
            return super().build_inputs(split, ctx)
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        sampler = StatefulDistributedSampler(self.train_set, num_replicas=ctx.world_size, rank=ctx.rank,
                                             shuffle=True, seed=ctx.seed, drop_last=True)
        return StatefulDataLoader(_Jittered(self.train_set, ctx.rank), batch_size=self.batch_size, sampler=sampler,
                                  num_workers=self.num_workers, drop_last=True)


class _Jittered(torch.utils.data.Dataset):
    """Adds noise to each sample from a generator of its own, one per worker (seeded by rank and
    worker), saved and restored with the loader's state: torchdata's StatefulDataLoader keeps a
    *Stateful* dataset's state per worker, while workers' global RNGs are re-seeded on resume."""

    def __init__(self, base: TensorDataset, rank: int) -> None:
        self.base = base
        self.rank = rank
        self._generator: torch.Generator | None = None

    def generator(self) -> torch.Generator:
        if self._generator is None:
            info = torch.utils.data.get_worker_info()
            self._generator = torch.Generator().manual_seed(1000 * (self.rank + 1) + (info.id if info else 0))
        return self._generator

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.01 * torch.randn(x.shape, generator=self.generator()), y

    def state_dict(self):
        return {"generator": self.generator().get_state()}

    def load_state_dict(self, state):
        self.generator().set_state(state["generator"])
