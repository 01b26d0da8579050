"""The trainer's input and its position, for exact resume: :class:`TrainData`.

The position is checkpointed through the data's ``state_dict`` / ``load_state_dict`` when it has
them (``{"kind": "stateful", "state": ...}``); otherwise as the number of batches consumed
(``{"kind": "replay", "batches": n}``), which a resume replays (draws and drops), in O(n).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

from cadence.extensions import Stateful
from cadence.errors import CheckpointError
from cadence.runtime.watchdog import unwatched
from cadence.torch.data import state as data_state
from cadence.torch.runtime.context import Context
from cadence.torch.task.task import Task

log = logging.getLogger(__name__)

__all__ = ["TrainData"]


class TrainData:
    """The training input of a trainer (``data``, default ``task.build_inputs("train", ctx)``,
    built on first use) and its iteration: the running iterator, the batches consumed, and a
    position restored from a checkpoint, applied when iteration (re)starts."""

    def __init__(self, task: Task, ctx: Context, data: Iterable[Any] | None = None) -> None:
        self._task = task
        self._ctx = ctx
        self._data = data
        self._iterator: Iterator[Any] | None = None
        self.batches_consumed = 0  # for replay when the data is not stateful; the loop adds its batches
        self._pending_state: dict[str, Any] | None = None

    @property
    def data(self) -> Iterable[Any]:
        """The training input (built from the task on first use)."""
        if self._data is None:
            with unwatched(self._ctx.heartbeat):  # a slow build (a download) is no hang
                self._data = self._task.build_inputs("train", self._ctx)
        return self._data

    def iterator(self) -> Iterator[Any]:
        """The running iterator; started (:meth:`start`) when there is none."""
        return self._iterator if self._iterator is not None else self.start()

    def start(self) -> Iterator[Any]:
        """Start iterating the data from the pending position (a restored one; none: the data's
        own start). A stateful data's state is loaded; otherwise the consumed batches are replayed."""
        data = self.data
        pending, self._pending_state = self._pending_state, None
        skip = 0
        if pending is not None:
            if pending.get("kind") == "stateful":
                if not isinstance(data, Stateful):
                    raise CheckpointError(
                        "the checkpoint's data position was saved through the train data's state_dict, "
                        f"but the train data ({type(data).__name__}) has no load_state_dict"
                    )
                data.load_state_dict(data_state.from_json(pending["state"]))
            else:
                skip = int(pending.get("batches", 0))
        self._iterator = iter(data)
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
        self.batches_consumed = skip
        return self._iterator

    def state(self) -> dict[str, Any] | None:
        """The position as JSON (see the module docstring); ``None``: never iterated nor restored."""
        if self._iterator is None:
            # Not iterated since construction / the last restore: the position is the pending one.
            return self._pending_state
        data = self._data
        if isinstance(data, Stateful):
            return {"kind": "stateful", "state": data_state.to_json(data.state_dict())}
        return {"kind": "replay", "batches": self.batches_consumed}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from ``state`` (a running iterator is dropped; ``None``: from the data's own
        start). The data is built and its iteration restarted now, so that whatever randomness
        that draws (a random split, a DataLoader's seed) happens before the caller restores the RNG."""
        self._iterator = None
        self.batches_consumed = 0
        self._pending_state = state
        self.start()
