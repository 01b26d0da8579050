"""Resuming a plain ``DataLoader`` over a map-style dataset mid-epoch without loading the skipped
samples: :func:`skipping_iterator`.

The loader's *sampler* is replayed (indices only: no ``__getitem__``) for the batches consumed,
and a new ``DataLoader`` that shares the dataset, collate function, worker settings and
``generator`` of the loader yields the rest of the epoch from the same sampler iteration. Its
iterator is created as ``iter(loader)`` would be, and the sampler starts after it, as in a replay:
the workers' base seed and every draw of the sampler (a ``RandomSampler``'s seed from the global
RNG or from its generator, a ``DistributedSampler``'s seed + epoch) are those of the uninterrupted
iteration, so the batches are too.

Only torch's own samplers qualify (exact types: a subclass may depend on anything); a custom
sampler, an ``IterableDataset``, a ``DataLoader`` subclass, persistent workers (whose workers
outlive an epoch: a new iterator would draw a new base seed), workers delivering out of order
(``in_order=False``: which batches were consumed depends on timing) or unbatched samples
(``batch_size=None``) with more than one worker give ``None``: the caller replays.

Workers take batches in turn (batch ``k`` goes to worker ``k % num_workers``): the new loader is
first given ``skip % num_workers`` empty batches (collated to a :class:`Pad` and dropped here,
nothing loaded; a dataset's ``__getitems__`` is called with ``[]``), so that every batch is loaded
by the worker that loaded it uninterrupted.

With workers, a skip is bit-identical also for the randomness drawn in them (a random
augmentation from a worker's global torch, ``numpy`` or ``random`` RNG): the new loader collates
through :class:`~cadence.torch.data.worker_rng.RngCollate`, so that the iterator keeps each
worker's RNG states after its last batch consumed (a
:class:`~cadence.torch.data.worker_rng.RngTracker`, the states the checkpoint saves), and given
the states saved, each worker of a resume sets its RNGs to them after the user's
``worker_init_fn`` (:class:`~cadence.torch.data.worker_rng.RestoreRng`). The caller iterates
every epoch of such a loader through :func:`skipping_iterator` (``skip=0``), so that the states
are known wherever it may save.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, TypeGuard

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from cadence.torch.data.worker_rng import RestoreRng, RngCollate, RngTracker, WorkerRng

__all__ = ["Pad", "PadCollate", "SkippingSampler", "skippable", "skipping_iterator"]

_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


class SkippingSampler:
    """The items of one iteration of ``sampler`` past its first ``skip`` (indices, or lists of
    indices for a batch sampler), after ``pad`` empty batches (``[]``). The iteration starts at
    :meth:`begin` or at the first item asked for, whichever is first; it is iterated once."""

    def __init__(self, sampler: Iterable[Any], skip: int, pad: int = 0) -> None:
        if skip < 0 or pad < 0:
            raise ValueError(f"skip and pad must be >= 0, got {skip} and {pad}")
        self._sampler = sampler
        self.skip = skip
        self.pad = pad
        self.skipped = 0  # items dropped (fewer than skip when the iteration ran out)
        self._iterator: Iterator[Any] | None = None

    def begin(self) -> None:
        """Start the sampler's iteration and drop the skipped items, if not done yet."""
        if self._iterator is not None:
            return
        self._iterator = iter(self._sampler)
        for _ in range(self.skip):
            try:
                next(self._iterator)
            except StopIteration:
                break
            self.skipped += 1

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        assert self._iterator is not None
        for _ in range(self.pad):
            yield []
        yield from self._iterator

    def __len__(self) -> int:
        return self.pad + max(0, len(self._sampler) - self.skip)  # type: ignore[arg-type]


class Pad:
    """What :class:`PadCollate` makes of an empty batch."""


class PadCollate:
    """``collate_fn``, except that an empty batch (a pad) collates to a :class:`Pad`."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        return Pad() if len(batch) == 0 else self.collate_fn(batch)


def skippable(loader: object) -> TypeGuard[DataLoader[Any]]:
    """Whether :func:`skipping_iterator` can resume ``loader`` (see the module doc)."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return False
    if loader.persistent_workers and loader.num_workers > 0:
        return False
    if loader.num_workers > 0 and not loader.in_order:
        return False  # batches in the order they arrive: which were consumed is known only by replaying
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return False
    if batch_sampler is None and loader.num_workers > 1:
        return False  # single samples cannot be padded to turn the workers' round
    sampler = loader.sampler if batch_sampler is None else batch_sampler.sampler
    return type(sampler) in _SAMPLERS


def skipping_iterator(loader: Iterable[Any], skip: int,
                      workers_rng: Mapping[int, WorkerRng] | None = None) -> tuple[Iterator[Any], int] | None:
    """An iterator of ``loader``'s current epoch from batch ``skip`` on, the samples of the
    batches before it never loaded, and the number of batches skipped (fewer than ``skip`` when
    the epoch is shorter); ``None`` when ``loader`` is not :func:`skippable`. Call it where
    ``iter(loader)`` would be (the same RNG state): it makes the same RNG draws as ``iter(loader)``
    followed by ``skip`` ``next()`` calls. With workers, the iterator is a
    :class:`~cadence.torch.data.worker_rng.RngTracker` (its workers' RNG states), and
    ``workers_rng`` are the states the workers had at batch ``skip`` (by worker id; a worker absent
    had not loaded a batch consumed in the epoch)."""
    if not skippable(loader):
        return None
    batch_sampler = loader.batch_sampler
    batched = batch_sampler is not None
    workers = loader.num_workers
    # Workers take batches in turn: pad so that batch `skip` goes to the worker it went to.
    pad = skip % workers if batched and workers > 1 and loader.in_order else 0
    sampler = SkippingSampler(batch_sampler if batch_sampler is not None else loader.sampler, skip, pad)
    collate_fn, worker_init_fn = loader.collate_fn, loader.worker_init_fn
    if workers:
        collate_fn = RngCollate(collate_fn)
        if workers_rng:
            worker_init_fn = RestoreRng(worker_init_fn, workers_rng)
    rest = DataLoader(
        loader.dataset,
        batch_size=1 if batched else None,
        sampler=None if batched else sampler,
        batch_sampler=sampler if batched else None,
        num_workers=workers,
        collate_fn=PadCollate(collate_fn) if pad else collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )
    iterator: Iterator[Any] = iter(rest)  # the workers' base seed, as iter(loader) draws it
    sampler.begin()  # then the sampler's draws, as the first next() would make them
    for _ in range(pad):  # in order: the pads come first
        if not isinstance(next(iterator), Pad):  # pragma: no cover - in_order
            raise RuntimeError("a DataLoader with in_order=True yielded a batch before the pads it was given first")
    if workers:
        iterator = RngTracker(iterator, sampler.skipped, workers_rng)
    return iterator, sampler.skipped
