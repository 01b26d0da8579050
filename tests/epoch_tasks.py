"""A Task on a plain ``torch.utils.data.DataLoader`` (finite, re-iterable) for the epoch tests
(loaded by path: ``tests/epoch_tasks.py:PlainLoaderTask``)."""

from __future__ import annotations

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
