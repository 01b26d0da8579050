"""How the processes of one job agree: the :class:`Coordinator` protocol.

The Controller is framework-agnostic; in a multi-process job it asks its coordinator to agree on
decisions (stop, roll back, save) at the end of each inner loop, so that every rank saves the
same step and stops at the same step. ``cadence.torch.runtime.distributed.TorchCoordinator`` implements it
on ``torch.distributed``; :class:`LocalCoordinator` is the single-process one.

Every method is a *collective*: all ranks must call it, in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Coordinator(Protocol):
    rank: int
    world_size: int

    @property
    def is_chief(self) -> bool:
        """Rank 0: the one process that writes checkpoints, summaries and exports."""
        ...

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one rank."""
        ...

    def barrier(self) -> None:
        """Return when every rank has called it."""
        ...

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` from rank ``src``, on every rank (picklable objects)."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        ...


@runtime_checkable
class GathersToOne(Protocol):
    """A coordinator that gathers onto one rank only (cheaper than :meth:`Coordinator.all_gather`)."""

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank ``dst``; ``None`` elsewhere."""
        ...


class LocalCoordinator:
    """The coordinator of a single process: every collective is immediate."""

    rank = 0
    world_size = 1

    @property
    def is_chief(self) -> bool:
        return True

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def barrier(self) -> None:
        return None

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]
