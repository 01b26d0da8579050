"""A Task on a plain ``torch.utils.data.DataLoader`` (finite, re-iterable) for the epoch tests
(loaded by path: ``tests/epoch_tasks.py:PlainLoaderTask``)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tasks import TinyTask


class Augmented(Dataset):
    """``base``'s samples with a random augmentation: noise drawn from the loading process's global
    torch, numpy and ``random`` RNGs (a worker's, with worker processes), as torchvision's
    transforms and numpy-based augmentations draw it."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        scale = 0.1 * (1 + random.random())
        noise = scale * (torch.randn_like(x) + torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32)))
        return x + noise, y


class PlainLoaderTask(TinyTask):
    """TinyTask on a plain DataLoader: shuffled from the global RNG, or with ``sampler`` over a
    ``DistributedSampler`` (each rank its shard, a new order per epoch through ``set_epoch``);
    ``num_workers`` worker processes; ``augment``: its samples randomly augmented (:class:`Augmented`)."""

    def __init__(self, sampler: bool = False, num_workers: int = 0, augment: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sampler = sampler
        self.num_workers = num_workers
        self.augment = augment

    def build_inputs(self, split, ctx):
        if split != "train":
            return super().build_inputs(split, ctx)
        dataset = Augmented(self.train_set) if self.augment else self.train_set
        if self.sampler:
            sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                         seed=ctx.seed, drop_last=True)
            return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)


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
