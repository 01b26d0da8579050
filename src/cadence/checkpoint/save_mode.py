"""Whether a checkpoint save runs asynchronously: ``async_save`` is True, False or ``"auto"``, and
``"auto"`` decides save by save (:class:`SaveMode`).

An asynchronous save stalls training only while the state is captured, but its commit then runs
beside the training steps, competing with them for the CPU and the GIL. For a small state the
synchronous save is over sooner than that competition: ``"auto"`` saves synchronously while the
write and commit of the last two saves took at most :data:`AUTO_COST_THRESHOLD` seconds (the
smaller of the two counts, so that one slow fsync does not switch modes), asynchronously once
both took longer. Before any save was measured, a state of at least :data:`AUTO_SIZE_THRESHOLD`
bytes (by the ``state_size`` estimate the framework layer passes) starts asynchronously; without
an estimate, the first save is synchronous.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

logger = logging.getLogger("cadence.checkpoint")

__all__ = ["AUTO", "AUTO_COST_THRESHOLD", "AUTO_SIZE_THRESHOLD", "AsyncSave", "SaveMode", "StateSize",
           "check_async_save"]

AUTO = "auto"
AsyncSave = bool | Literal["auto"]
"""``async_save``'s values: always (True), never (False), or chosen per save (``"auto"``)."""

StateSize = Callable[[], int]
"""An estimate of the bytes the next save writes (the framework layer's: parameters, buffers,
optimizer and EMA state); called at most once, before the first measured save."""

AUTO_COST_THRESHOLD = 0.02
"""Seconds of a save's write and commit above which ``"auto"`` makes the next save asynchronous
(the crossover measured with ``benchmarks/checkpoint/save_mode_crossover.py``; see docs/guide/performance.md)."""

AUTO_SIZE_THRESHOLD = 16 << 20
"""Bytes of state from which ``"auto"``'s first save, not yet measured, is asynchronous."""


def check_async_save(value: object) -> AsyncSave:
    """``value`` when it is True, False or ``"auto"``; else ``ValueError`` naming it."""
    if value is True or value is False or value == AUTO:
        return value  # type: ignore[return-value]  # narrowed by the test above
    raise ValueError(f"async_save must be True, False or 'auto', got {value!r}")


class SaveMode:
    """Decides whether each save is asynchronous (see the module doc).

    ``async_save``: True / False decide every save; ``"auto"``: :meth:`asynchronous` follows the
    smaller of the last two costs given to :meth:`record` (``cost_threshold``), else
    ``state_size()`` (``size_threshold``), else False.
    """

    def __init__(self, async_save: AsyncSave, *, state_size: StateSize | None = None,
                 cost_threshold: float = AUTO_COST_THRESHOLD, size_threshold: int = AUTO_SIZE_THRESHOLD) -> None:
        self.setting = check_async_save(async_save)
        self.state_size = state_size
        self.cost_threshold = cost_threshold
        self.size_threshold = size_threshold
        self.last_cost: float | None = None  # the last save's write and commit, seconds
        self._previous_cost: float | None = None
        self._estimated: bool | None = None

    @property
    def auto(self) -> bool:
        return self.setting == AUTO

    def asynchronous(self) -> bool:
        """Whether the next save is asynchronous."""
        if not self.auto:
            return bool(self.setting)
        if self.last_cost is not None:
            costs = [c for c in (self.last_cost, self._previous_cost) if c is not None]
            return min(costs) > self.cost_threshold
        if self._estimated is None:
            self._estimated = self._large_state()
        return self._estimated

    def record(self, seconds: float) -> None:
        """The write and commit of the save just done took ``seconds`` (on whichever thread ran them)."""
        self._previous_cost, self.last_cost = self.last_cost, seconds

    def _large_state(self) -> bool:
        if self.state_size is None:
            return False
        try:
            size = self.state_size()
        except Exception:  # noqa: BLE001 - an estimate only: measure a synchronous save instead
            logger.warning("could not estimate the checkpoint's size; the first save is synchronous", exc_info=True)
            return False
        return size >= self.size_threshold
