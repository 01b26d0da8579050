"""A sidecar of several ranks: the chief decides, every rank evaluates.

The continuous-evaluation loop (:class:`~cadence.sidecar.continuous.ContinuousEvaluation`) runs on
the chief (rank 0) alone: it alone watches ``checkpoints/``, holds the sidecar's lease, reads and
writes ``evaluations.jsonl`` and decides which step comes next, whether a checkpoint is retried,
recorded as failed or skipped, and when to stop. What needs every rank -- restoring a checkpoint
and evaluating it, both collectives -- goes through :class:`ChiefRun`, which broadcasts each
command to the other ranks before running it itself; the other ranks run :func:`follow`, which
does what the chief broadcasts until it broadcasts the end.

The commands (broadcast by the chief through the run's coordinator, one object each):

- ``("restore", step)``: restore checkpoint ``step`` (collective); a ``CheckpointError`` is the
  chief's to handle (every rank gets the same one: the ranks first agree that each sees the
  checkpoint committed, then on its verification),
- ``("evaluate", steps)``: evaluate the restored state (collective: the data is sharded over the
  ranks and the metrics reduced exactly; eval actions run as in training, the chief writing),
- ``("wait", None)``: sent at least every ``tick_s`` seconds while the chief waits for a
  checkpoint, so that no rank sits in a collective past the process group's timeout; followed by an
  agreement on stopping (any rank asked to stop, by SIGTERM or SIGINT, stops them all),
- ``("end", result)``: the chief's :class:`~cadence.sidecar.continuous.SidecarResult`; every rank
  returns it,
- ``("error", message)``: the chief failed outside a collective; the others raise
  :class:`SidecarChiefError` with its message.

Framework-agnostic: any :class:`~cadence.runtime.coordination.Coordinator`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from cadence.checkpoint import CheckpointManager
from cadence.errors import CadenceError, CheckpointError
from cadence.runtime.coordination import Coordinator
from cadence.sidecar.continuous import EvaluationRun, SidecarResult

logger = logging.getLogger("cadence.sidecar.evaluator")

__all__ = ["TICK_S", "ChiefRun", "SidecarChiefError", "follow"]

TICK_S = 1.0
"""Seconds between the chief's ``wait`` messages while it waits for a checkpoint: the most a stop
asked of another rank waits, and far below a process group's collective timeout."""


class SidecarChiefError(CadenceError):
    """The sidecar's chief failed (its message says why); raised on the other ranks."""

    exit_code = 1


class ChiefRun:
    """The chief's :class:`~cadence.sidecar.continuous.EvaluationRun`: each restore and evaluation
    is broadcast to the other ranks (running :func:`follow`) before the chief runs it with them.

    ``run``: the chief's controller (with the ranks' coordinator); ``coordinator``: the ranks';
    ``tick_s``: see :data:`TICK_S`; ``clock``: monotonic seconds."""

    def __init__(self, run: EvaluationRun, coordinator: Coordinator, *, tick_s: float = TICK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not coordinator.is_chief:
            raise ValueError("ChiefRun runs on the chief (rank 0); the other ranks follow()")
        self.run = run
        self.coordinator = coordinator
        self.tick_s = tick_s
        self._clock = clock
        self._last = clock()
        logger.info("a sidecar of %d ranks: rank 0 watches the checkpoints, holds the lease and records; every rank "
                    "evaluates", coordinator.world_size)

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        return self.run.checkpoint_manager

    def restore(self, step: int | None = None) -> int | None:
        self._send("restore", step)
        _all_see(self.run, self.coordinator, step)
        return self.run.restore(step)

    def evaluate(self, steps: int = -1) -> dict[str, Any]:
        self._send("evaluate", steps)
        return self.run.evaluate(steps)

    def should_stop(self, asked: Callable[[], bool]) -> Callable[[], bool]:
        """The loop's ``should_stop``: ``asked()`` on the chief, and, once every ``tick_s`` seconds, a
        ``wait`` message and the ranks' agreement (a stop asked of any rank)."""

        def poll() -> bool:
            if asked():
                return True
            if self._clock() - self._last < self.tick_s:
                return False
            self._send("wait", None)
            return self.coordinator.any(False)

        return poll

    def end(self, result: SidecarResult) -> None:
        """Tell the other ranks the sidecar ended with ``result``; they return it."""
        self._send("end", result)

    def fail(self, error: BaseException) -> None:
        """Best effort: tell the other ranks the chief failed with ``error`` (they raise
        :class:`SidecarChiefError`). A rank already gone (the reason of many failures) makes this
        raise in turn: that is swallowed, ``error`` is what the chief reports."""
        try:
            self._send("error", f"{type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - the chief's own error is the one raised
            logger.debug("could not tell the other ranks of the chief's failure", exc_info=True)

    def _send(self, command: str, value: Any) -> None:
        self.coordinator.broadcast((command, value))
        self._last = self._clock()


def follow(run: EvaluationRun, coordinator: Coordinator, asked: Callable[[], bool]) -> SidecarResult:
    """A non-chief rank of the sidecar: do what the chief broadcasts (:class:`ChiefRun`) until it
    ends; return the chief's result. ``asked``: True once this rank was asked to stop (SIGTERM):
    told to every rank at the chief's next ``wait``.

    A ``CheckpointError`` while restoring or evaluating is the chief's to handle (it retries,
    records the checkpoint as failed or skipped): this rank waits for the next command. Any other
    error ends this rank (and the job: torchrun stops the others)."""
    if coordinator.is_chief:
        raise ValueError("follow() runs on the ranks other than the chief")
    while True:
        message: tuple[str, Any] = coordinator.broadcast(("", None))  # the chief's; this rank's is not sent
        command, value = message
        if command == "restore":
            try:
                _all_see(run, coordinator, value)
                run.restore(value)
            except CheckpointError as e:
                logger.debug("rank %d: restoring checkpoint %s failed (the chief decides): %s",
                             coordinator.rank, value, e)
        elif command == "evaluate":
            try:
                run.evaluate(value)
            except CheckpointError as e:
                logger.debug("rank %d: evaluation failed (the chief decides): %s", coordinator.rank, e)
        elif command == "wait":
            coordinator.any(asked())
        elif command == "end":
            return value
        elif command == "error":
            raise SidecarChiefError(f"the sidecar's chief (rank 0) failed: {value}")
        else:
            raise RuntimeError(f"unknown sidecar command from the chief: {command!r}")


def _all_see(run: EvaluationRun, coordinator: Coordinator, step: int | None) -> None:
    """Collective, before a restore: every rank sees checkpoint ``step`` committed, or every rank raises
    the same ``CheckpointError`` naming those that do not (a model dir not shared by every node, or a
    checkpoint deleted since the chief picked it), so that no rank enters the restore's collectives alone."""
    manager = run.checkpoint_manager
    sees = step is None or manager is None or step in manager.steps()
    blind = [rank for rank, seen in enumerate(coordinator.all_gather(sees)) if not seen]
    if blind:
        ranks = ", ".join(map(str, blind))
        raise CheckpointError(f"checkpoint {step} is not committed as rank {ranks} of the sidecar sees the model dir "
                              "(deleted since, or a model dir not shared by every node)")
