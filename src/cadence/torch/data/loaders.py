"""Data order that can be resumed mid-epoch without replaying: a sampler and a loader.

Positions are counted in *global* samples of an epoch's permutation, so a saved position means
the same thing on every rank (and for any number of workers). Rank ``r`` of ``W`` takes the
positions ``offset + r, offset + r + W, ...``: no padding and no duplicates, so with an uneven
remainder some ranks get one sample fewer. Batch ``k`` of every rank comes from the same global
batch (positions ``[k*W*B, (k+1)*W*B)``), so ``offset = batches consumed * W * B``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler


class ResumableSampler(Sampler[int]):
    """Indices of one epoch for one rank, startable at any global position in O(1).

    The order of epoch ``e`` is ``torch.randperm(num_samples)`` drawn from
    ``torch.Generator().manual_seed(seed + e)`` (the identity when ``shuffle=False``).
    ``drop_last=True`` drops the last ``num_samples % world_size`` positions so that every rank
    gets the same number of indices. ``len()`` is the number of indices the next iteration
    yields (from the current offset).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0

    @property
    def epoch_size(self) -> int:
        """Global positions used per epoch (all ranks together)."""
        if self.drop_last:
            return self.num_samples - self.num_samples % self.world_size
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s permutation (does not change the offset)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def set_offset(self, offset: int) -> None:
        """Start the next iteration at global position ``offset`` of the epoch (0 = its start)."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.offset = int(offset)

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The global order of ``epoch`` (default: the current one), an int64 tensor."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        start = self.offset + self.rank
        if start >= self.epoch_size:
            return iter(())
        return iter(self.permutation()[start : self.epoch_size : self.world_size].tolist())

    def __len__(self) -> int:
        return max(0, math.ceil((self.epoch_size - self.offset - self.rank) / self.world_size))


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return bool(acc.is_available())
    return torch.cuda.is_available()


class ResumableLoader:
    """Batches of a map-style dataset whose position can be saved and restored exactly.

    Built on ``torch.utils.data.DataLoader`` with a :class:`ResumableSampler`; ``batch_size`` is
    per rank. ``epochs=None`` repeats forever with a new permutation each epoch; ``epochs=k``
    stops after ``k`` passes. ``drop_last=True`` drops each epoch's incomplete global batch, so
    that every rank yields the same number of batches (use it for multi-rank training), also
    after resuming a position saved by another world size.

    It counts the batches *handed out* (not what workers prefetched): :meth:`state_dict` is
    ``{"epoch": e, "offset": global samples consumed in epoch e}``. Each ``iter()`` starts
    from the beginning, except the first one after :meth:`load_state_dict`, which continues
    from the loaded position with exactly the batches an uninterrupted iteration would have
    yielded (skipping is a slice: skipped samples are never loaded). Starting an iteration
    (or loading a state) ends the iterators started before. ``len()`` is the number of
    batches of a whole epoch for this rank. Extra keywords go to ``DataLoader``.
    :meth:`set_epoch` numbers the passes of the next fresh iterations (cadence calls it with its
    epoch when a finite loader runs out and is iterated again).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        epochs: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("ResumableLoader needs a map-style dataset (with __len__ and __getitem__)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be None or >= 0, got {epochs}")
        for key in ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last", "generator"):
            if key in dataloader_kwargs:
                raise TypeError(f"ResumableLoader sets DataLoader's {key!r} itself")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.epochs = epochs
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.sampler = ResumableSampler(
            len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
        )
        self._dataloader_kwargs = dict(
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory and _accelerator_available(),
            **dataloader_kwargs,
        )
        self._epoch = 0
        self._offset = 0
        self._resume_pending = False
        self._generation = 0
        self._first = 0  # the pass an iteration started afresh begins at (set_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Iterations started afresh begin at pass ``epoch * epochs`` (``epochs=None``: ``epoch``)
        and make ``epochs`` passes, each with its own permutation; an iteration after
        :meth:`load_state_dict` continues the loaded pass, up to the same bound."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._first = int(epoch) * (self.epochs if self.epochs is not None else 1)

    # -- position ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "offset"}``: where the next batch comes from (JSON-serialisable)."""
        return {"epoch": self._epoch, "offset": self._offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``. Raises ``ValueError`` if malformed."""
        try:
            epoch, offset = int(state["epoch"]), int(state["offset"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad ResumableLoader state {state!r}: need ints 'epoch' and 'offset'") from e
        if epoch < 0 or offset < 0:
            raise ValueError(f"bad ResumableLoader state {state!r}: epoch and offset must be >= 0")
        self._epoch, self._offset = epoch, offset
        self._resume_pending = True
        self._generation += 1

    # -- iteration -----------------------------------------------------------------------------

    def _num_batches(self, num_indices: int) -> int:
        if self.drop_last:
            return num_indices // self.batch_size
        return math.ceil(num_indices / self.batch_size)

    def __len__(self) -> int:
        s = self.sampler
        per_rank = max(0, math.ceil((s.epoch_size - s.rank) / s.world_size))
        return self._num_batches(per_rank)

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        if not self._resume_pending:
            self._epoch, self._offset = self._first, 0
        self._resume_pending = False
        return self._batches(self._generation)

    def _batches(self, generation: int) -> Iterator[Any]:
        step = self.batch_size * self.world_size
        while self.epochs is None or self._epoch < self._first + self.epochs:
            if generation != self._generation:
                return
            epoch, offset = self._epoch, self._offset
            self.sampler.set_epoch(epoch)
            self.sampler.set_offset(offset)
            if self.drop_last:
                # Whole global batches left: the same count on every rank, also when the offset
                # was saved by another world size and is not a multiple of this one.
                left = max(0, self.sampler.epoch_size - offset) // step
            else:
                left = self._num_batches(len(self.sampler))
            if left == 0:
                if offset == 0:
                    return  # a whole epoch holds no batch for this rank: stop instead of spinning
                self._epoch, self._offset = epoch + 1, 0
                continue
            # A private generator: creating the iterator must not draw from the global torch RNG
            # (that would make the training RNG stream depend on where iteration was resumed).
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_003 + offset)
            loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=self.sampler,
                drop_last=self.drop_last,
                generator=g,
                **self._dataloader_kwargs,
            )
            for batch in loader:
                left -= 1
                if left <= 0:
                    self._epoch, self._offset = epoch + 1, 0
                else:
                    self._offset += step
                yield batch
                if generation != self._generation:
                    return
                if left <= 0:  # with drop_last, this rank's sampler may hold a few more samples
                    break
            if left > 0:  # pragma: no cover - DataLoader yields at least `left` batches
                self._epoch, self._offset = epoch + 1, 0
