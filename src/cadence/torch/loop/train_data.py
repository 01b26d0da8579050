"""The trainer's input and its position, for exact resume: :class:`TrainData`.

The position is checkpointed through the data's ``state_dict`` / ``load_state_dict`` when it has
them (``{"kind": "stateful", "state": ...}``); otherwise as the number of batches consumed
(``{"kind": "replay", "batches": n}``): a resume of a plain ``DataLoader`` with torch's own samplers
skips them without loading their samples (:mod:`cadence.torch.data.sampler_skip`); any other
input is replayed (its batches drawn and dropped, in O(n), with a warning). Such a loader with
workers is iterated, every epoch, through the skip's loader, which keeps each worker's RNG states
after its last batch consumed: the position holds them as ``"workers_rng"`` (by worker id, see
:mod:`cadence.torch.data.worker_rng`), and a resume's workers continue from them.

Epochs: a re-iterable input (``iter(data) is not data``: a DataLoader, a list) that runs out is
iterated again, as Lightning, HF Trainer and torchtnt do, after ``set_epoch(epoch)`` on the data
when it has one, else on its ``sampler`` / ``batch_sampler`` (a ``DistributedSampler``). From
epoch 1 on, the position holds ``"epoch"``; a replayed one also holds ``"rng"``, the torch CPU RNG
state (and that of the loader's own ``generator`` and its sampler's) at that epoch's start, which a resume iterates under,
so that a shuffled ``DataLoader`` repeats the order it drew. A one-shot iterator (a generator) that
runs out ends the training data, and so does the end of epoch ``max_epochs - 1``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Protocol, Sized, runtime_checkable

import torch

from cadence.extensions import Stateful
from cadence.errors import CheckpointError, ConfigError
from cadence.runtime.watchdog import unwatched
from cadence.torch.data import sampler_skip
from cadence.torch.data import state as data_state
from cadence.torch.data import worker_rng
from cadence.torch.data.loaders import ResumableLoader
from cadence.torch.runtime.context import Context
from cadence.torch.task.task import Task

log = logging.getLogger(__name__)

__all__ = ["TrainData", "batches_per_epoch", "set_epoch"]


@runtime_checkable
class _SetsEpoch(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


def set_epoch(data: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on ``data`` when it has one, else on its ``sampler`` and
    ``batch_sampler`` that have one (a ``DistributedSampler``); nothing otherwise."""
    if isinstance(data, _SetsEpoch):
        data.set_epoch(epoch)
        return
    for name in ("sampler", "batch_sampler"):
        sampler = getattr(data, name, None)
        if isinstance(sampler, _SetsEpoch):
            sampler.set_epoch(epoch)


def batches_per_epoch(data: Iterable[Any]) -> int | None:
    """``len(data)``: the batches of one epoch of a training input on this process; ``None`` when it
    has no length (a generator, a ``DataLoader`` over an ``IterableDataset`` without ``__len__``) or no
    epochs (a one-shot iterator, even one with a length: ``iter(loader)``)."""
    if not isinstance(data, Sized) or isinstance(data, Iterator):
        return None
    try:
        return len(data)
    except TypeError:  # DataLoader.__len__ of an IterableDataset without one
        return None


def _generators(data: Any) -> dict[str, torch.Generator]:
    """The random generators a ``DataLoader`` draws from besides the global RNG: its own
    (``"generator"``) and its sampler's, or its batch sampler's sampler's, when another one
    (``"sampler_generator"``)."""
    found: dict[str, torch.Generator] = {}
    generator = getattr(data, "generator", None)
    if isinstance(generator, torch.Generator):
        found["generator"] = generator
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for owner in (sampler, getattr(batch_sampler, "sampler", None)):
        own = getattr(owner, "generator", None)
        if isinstance(own, torch.Generator) and own is not generator:
            found["sampler_generator"] = own
            break
    return found


def _rng_state(data: Any) -> dict[str, Any]:
    """The torch CPU RNG state and the loader's generators' (:func:`_generators`), as JSON: what a
    ``DataLoader`` draws from when an iteration starts."""
    state = {"cpu": data_state.to_json(torch.get_rng_state())}
    for name, generator in _generators(data).items():
        state[name] = data_state.to_json(generator.get_state())
    return state


class TrainData:
    """The training input of a trainer (``data``, default ``task.build_inputs("train", ctx)``,
    built on first use) and its iteration: the running iterator, the epoch and the batches consumed
    in it, and a position restored from a checkpoint, applied when iteration (re)starts.
    ``max_epochs``: :meth:`next_epoch` starts no epoch past it (``None``: no bound).
    ``ends_with_data``: only the data's end ends training (``trainer.train_steps`` is null); then a
    re-iterable input without ``max_epochs`` would never end: a :class:`ConfigError` when it starts."""

    def __init__(self, task: Task, ctx: Context, data: Iterable[Any] | None = None, *,
                 max_epochs: int | None = None, ends_with_data: bool = False) -> None:
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be None or >= 1, got {max_epochs}")
        self._task = task
        self._ctx = ctx
        self._data = data
        self._iterator: Iterator[Any] | None = None
        self.batches_consumed = 0  # in this epoch, for replay when the data is not stateful; the loop adds its batches
        self._pending_state: dict[str, Any] | None = None
        self.max_epochs = max_epochs
        self.ends_with_data = ends_with_data
        self.epoch = 0
        self.ended = False  # max_epochs are done
        self._epoch_rng: dict[str, Any] | None = None  # the RNG at this epoch's start (epochs >= 1, replayed data)

    @property
    def data(self) -> Iterable[Any]:
        """The training input (built from the task on first use)."""
        if self._data is None:
            with unwatched(self._ctx.heartbeat):  # a slow build (a download) is no hang
                self._data = self._task.build_inputs("train", self._ctx)
        return self._data

    @property
    def batches_per_epoch(self) -> int | None:
        """:func:`batches_per_epoch` of the training input (built now when it was not)."""
        return batches_per_epoch(self.data)

    def iterator(self) -> Iterator[Any]:
        """The running iterator; started (:meth:`start`) when there is none."""
        return self._iterator if self._iterator is not None else self.start()

    @property
    def has_epochs(self) -> bool:
        """Whether the input (built now) ends epochs: not a one-shot iterator, nor an endless
        :class:`~cadence.torch.data.loaders.ResumableLoader` (``epochs=None``: its epochs run on in one iteration)."""
        data = self.data
        return not isinstance(data, Iterator) and not (isinstance(data, ResumableLoader) and data.epochs is None)

    @property
    def reiterable(self) -> bool:
        """Whether the running iteration is of a re-iterable input (which has epochs)."""
        return self._iterator is not None and self._iterator is not self._data

    def start(self) -> Iterator[Any]:
        """Start iterating the data from the pending position (a restored one; none: the data's
        own start). A stateful data's state is loaded; otherwise the consumed batches are skipped or
        replayed (:meth:`_resume`), under the RNG state saved at the epoch's start when there is one."""
        data = self.data
        pending, self._pending_state = self._pending_state, None
        skip, workers_rng = 0, None
        self.epoch, self.ended, rng = 0, False, None
        if pending is not None:
            self.epoch = int(pending.get("epoch", 0))
            set_epoch(data, self.epoch)
            if pending.get("kind") == "stateful":
                if not isinstance(data, Stateful):
                    raise CheckpointError(
                        "the checkpoint's data position was saved through the train data's state_dict, "
                        f"but the train data ({type(data).__name__}) has no load_state_dict"
                    )
                data.load_state_dict(data_state.from_json(pending["state"]))
            else:
                skip = int(pending.get("batches", 0))
                rng = pending.get("rng")
                workers_rng = {int(w): worker_rng.from_json(s) for w, s in pending.get("workers_rng", {}).items()}
        else:
            set_epoch(data, 0)
        self._epoch_rng = rng
        if rng is not None:
            with torch.random.fork_rng(devices=[]):  # the epoch's start as it was; the caller restores the RNG
                torch.set_rng_state(data_state.from_json(rng["cpu"]))
                for name, generator in _generators(data).items():
                    if name in rng:
                        generator.set_state(data_state.from_json(rng[name]))
                self._resume(data, skip, workers_rng)
        else:
            self._resume(data, skip, workers_rng)
            if self.ends_with_data and self.max_epochs is None and self.reiterable:
                raise ConfigError(
                    f"trainer.train_steps and trainer.max_epochs are both null, and the train data ({type(data).__name__}) "
                    "is re-iterable: its epochs would never end; set trainer.train_steps or trainer.max_epochs")
        self.batches_consumed = skip
        assert self._iterator is not None
        return self._iterator

    def next_epoch(self, consumed: int = 0) -> tuple[Iterator[Any], Any] | None:
        """After the running iterator ran out, having given ``consumed`` batches not yet counted in
        :attr:`batches_consumed` (they are added first): start the next epoch; its iterator and
        first batch. ``None`` (the data has ended): a one-shot iterator, ``max_epochs`` done
        (:attr:`ended`), or an epoch without a batch."""
        self.batches_consumed += consumed
        data = self.data
        if not self.reiterable:
            return None
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            self.ended = True
            log.info("the train data's epoch %d ended: trainer.max_epochs (%d) reached", self.epoch, self.max_epochs)
            return None
        self.epoch += 1
        self.batches_consumed = 0
        set_epoch(data, self.epoch)
        self._epoch_rng = None if isinstance(data, Stateful) else _rng_state(data)
        self._iterator = self._iterate(data)
        try:
            first = next(self._iterator)
        except StopIteration:
            log.warning("the train data yielded no batch in epoch %d: it has ended", self.epoch)
            return None
        return self._iterator, first

    @staticmethod
    def _tracks_workers(data: Iterable[Any]) -> bool:
        """Whether ``data`` is iterated through the skip's loader, which keeps its workers' RNG
        states: a skippable ``DataLoader`` with worker processes."""
        return sampler_skip.skippable(data) and data.num_workers > 0

    def _iterate(self, data: Iterable[Any]) -> Iterator[Any]:
        """A new iteration of ``data`` from its start (its workers' RNG states kept, when it has workers)."""
        skipping = sampler_skip.skipping_iterator(data, 0) if self._tracks_workers(data) else None
        return iter(data) if skipping is None else skipping[0]

    def _resume(self, data: Iterable[Any], skip: int, workers_rng: dict[int, worker_rng.WorkerRng] | None) -> None:
        """Start iterating ``data`` past its first ``skip`` batches: skipped without loading them
        (a plain ``DataLoader`` with torch's samplers: :mod:`cadence.torch.data.sampler_skip`, its
        workers set to ``workers_rng``), else replayed."""
        skipping = sampler_skip.skipping_iterator(data, skip, workers_rng) if skip else None
        if skipping is None:
            self._iterator = self._iterate(data)
            self._replay(skip)
            return
        self._iterator, skipped = skipping
        log.info("resuming the train data at batch %d without loading the skipped samples", skip)
        if skipped < skip:
            log.warning("train data exhausted after skipping %d of %d batches", skipped, skip)

    def _replay(self, skip: int) -> None:
        assert self._iterator is not None
        if skip:
            log.warning(
                "resuming the train data by replaying %d batches (O(n)); give the train data "
                "state_dict/load_state_dict (e.g. cadence.torch.ResumableLoader) to resume in O(1)",
                skip,
            )
            for i in range(skip):
                try:
                    next(self._iterator)
                except StopIteration:
                    log.warning("train data exhausted after replaying %d of %d batches", i, skip)
                    break

    def close(self) -> None:
        """End the running iteration: a multi-process loader's workers exit now. Left to the garbage
        collector (a loader's iterator sits in a reference cycle), a DataLoader iterator's ``__del__``
        finds its queues already closed and waits up to 5 s per worker for workers that never hear
        they may stop."""
        for iterator in (self._iterator, getattr(self._data, "_iterator", None)):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        self._iterator = None

    def state(self, pending: int = 0) -> dict[str, Any] | None:
        """The position as JSON (see the module docstring); ``None``: never iterated nor restored.
        ``pending``: batches drawn in this epoch that the running loop has not added to
        :attr:`batches_consumed` yet (a position taken mid-loop)."""
        if self._iterator is None:
            # Not iterated since construction / the last restore: the position is the pending one.
            return self._pending_state
        data = self._data
        position: dict[str, Any]
        if isinstance(data, Stateful):
            position = {"kind": "stateful", "state": data_state.to_json(data.state_dict())}
        else:
            position = {"kind": "replay", "batches": self.batches_consumed + pending}
            if self._epoch_rng is not None:
                position["rng"] = self._epoch_rng
            if isinstance(self._iterator, worker_rng.RngTracker):
                workers = self._iterator.states(self.batches_consumed + pending)
                if workers:
                    position["workers_rng"] = {str(w): worker_rng.to_json(s) for w, s in sorted(workers.items())}
        if self.epoch:
            position["epoch"] = self.epoch
        return position

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from ``state`` (a running iterator is dropped; ``None``: from the data's own
        start). The data is built and its iteration restarted now, so that whatever randomness
        that draws (a random split, a DataLoader's seed) happens before the caller restores the RNG."""
        self._iterator = None
        self.batches_consumed = 0
        self._pending_state = state
        self.start()
