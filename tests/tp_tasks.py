"""A tiny tensor-parallel Task for the device-mesh tests (``tests/tp_tasks.py:TPTask``): an 8-16-2 MLP
whose plan splits the first layer by columns and the second by rows over ``mesh["tp"]``; and
:class:`WriteRestored`, the callback that writes the full state a run restored (``restored_to``)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from cadence import Callback
from cadence.torch import ResumableLoader, Task
from tasks import synthetic


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The full (unsharded) model and optimizer state of a run, as CPU tensors: ``{"model": {fqn: tensor},
    "optimizer": {"<fqn>.<name>": tensor}}`` (Adam's ``step``, ``exp_avg``, ``exp_avg_sq`` of each parameter).
    A collective with a process group (every rank calls it; rank 0 gets the state, the others None)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if distributed else None
    weights = get_model_state_dict(model, options=options)
    moments = get_optimizer_state_dict(model, optimizer, options=options)
    if distributed and dist.get_rank() != 0:
        return None
    return {"model": {k: v.detach().clone() for k, v in weights.items()},
            "optimizer": {f"{fqn}.{name}": v.detach().clone() for fqn, state in moments["state"].items()
                          for name, v in state.items()}}


class WriteRestored(Callback):
    """Right after a checkpoint is restored (before the first step), writes the run's full model and
    optimizer state to ``path`` (``torch.save`` on rank 0; see :func:`full_state`), with the restored step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_checkpoint_load(self, run: Any, checkpoint_dir: str) -> None:
        state = full_state(run.trainer.model, run.trainer.optimizer)
        if state is not None:
            torch.save({**state, "step": run.global_step}, self.path)


class TPTask(Task):
    """``digest_dir``: each rank appends a digest of every training batch to ``digest_dir/rank<N>``
    (the tests compare what the ranks of a TP group and of the data-parallel dimensions read).
    ``tp_divisor``: what ``trainer.parallel.tp`` must divide (the hidden width splits over it).
    ``restored_to``: a file the full state restored from a checkpoint is written to (:class:`WriteRestored`).
    ``step_sleep`` slows each step down (a test kills the run mid-way); ``pid_dir`` gets a file
    ``rank<N>`` with each process's pid (as TinyTask's, for ``cli_run.killed_after``)."""

    def __init__(self, global_batch_size: int = 8, n: int = 128, digest_dir: str | None = None,
                 tp_divisor: int = 16, restored_to: str | None = None, step_sleep: float = 0.0,
                 pid_dir: str | None = None) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.digest_dir = digest_dir
        self.tp_divisor = tp_divisor
        self.restored_to = restored_to
        self.step_sleep = step_sleep
        if pid_dir is not None:
            Path(pid_dir, f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
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

    def build_callbacks(self) -> list:
        return [WriteRestored(self.restored_to)] if self.restored_to is not None else []

    def train_step(self, model, batch):
        if self.step_sleep:
            time.sleep(self.step_sleep)
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
