"""A Task on a plain ``torch.utils.data.DataLoader`` (finite, re-iterable) for the epoch tests
(loaded by path: ``tests/epoch_tasks.py:PlainLoaderTask``)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from tasks import TinyTask


class PlainLoaderTask(TinyTask):
    """TinyTask on a plain DataLoader: shuffled from the global RNG, or with ``sampler`` over a
    ``DistributedSampler`` (each rank its shard, a new order per epoch through ``set_epoch``);
    ``num_workers`` worker processes."""

    def __init__(self, sampler: bool = False, num_workers: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sampler = sampler
        self.num_workers = num_workers

    def build_inputs(self, split, ctx):
        if split != "train":
            return super().build_inputs(split, ctx)
        if self.sampler:
            sampler = DistributedSampler(self.train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                         seed=ctx.seed, drop_last=True)
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)


class EpochLRTask(PlainLoaderTask):
    """PlainLoaderTask whose StepLR(step_size=1, gamma=0.5) is stepped per epoch: it halves the rate at
    each epoch's end (an ImageNet script's ``StepLR(step_size=30)`` ported unchanged, with 1 for 30)."""

    def configure_lr_scheduler(self, optimizer, plan):
        from cadence.torch import LRSchedule

        assert plan.steps_per_epoch == len(self.train_set) // self.batch_size, plan  # the train input's length
        return LRSchedule(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), interval="epoch")


class UnsizedTask(PlainLoaderTask):
    """PlainLoaderTask on a one-shot generator of batches: no length, no epochs."""

    def build_inputs(self, split, ctx):
        loader = super().build_inputs(split, ctx)
        return (batch for batch in loader) if split == "train" else loader
