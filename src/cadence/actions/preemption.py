"""Save on preemption (Orbit's ``SaveCheckpointIfPreempted``), on SIGTERM as well as SLURM's SIGUSR1."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Iterable

from cadence.errors import PreemptedExit

logger = logging.getLogger("cadence.actions")

DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name)
)


class SaveCheckpointIfPreempted:
    """A train action: after a termination signal, commit a checkpoint and exit cleanly.

    When attached to a :class:`~cadence.Controller` it installs handlers for ``signals``
    (default SIGTERM, SIGUSR1, SIGINT) that only record the signal. At the end of the current
    inner loop the action commits a checkpoint at the current step and then raises
    :class:`~cadence.errors.PreemptedExit` (a ``SystemExit`` with ``exit_code``, default 0: the
    job is not a failure, a scheduler may restart it),
    or, with ``keep_running=True``, clears the flag and lets training go on.

    Signals arriving while the checkpoint is being written are recorded and nothing else: the
    save completes (and the commit protocol makes even a SIGKILL there harmless). A second SIGINT
    *before* the save starts raises ``KeyboardInterrupt`` at once -- a way out of a loop that
    will not end -- which loses only the steps since the last checkpoint.

    In a multi-process job a signal received by *any* rank is agreed on at the end of the inner
    loop: all ranks commit the same step and exit.

    Handlers can only be installed from the main thread; elsewhere a warning is logged and the
    action does nothing. :meth:`close` (called by ``Controller.close``) restores the previous
    handlers.
    """

    def __init__(
        self, signals: Iterable[int] = DEFAULT_SIGNALS, *, keep_running: bool = False, exit_code: int = 0
    ) -> None:
        self.signals = tuple(signals)
        self.keep_running = keep_running
        self.exit_code = exit_code
        self.received: int | None = None
        self._sigint = False
        self._saving = False
        self._controller: Any = None
        self._previous: dict[int, Any] = {}

    @property
    def preempted(self) -> bool:
        """Whether a signal was received and not yet acted on."""
        return self.received is not None

    def attach(self, controller: Any) -> None:
        self._controller = controller
        if threading.current_thread() is not threading.main_thread():
            logger.warning("SaveCheckpointIfPreempted: not in the main thread; signal handlers not installed")
            return
        for signum in self.signals:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)  # attached twice: keep the originals

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self._sigint and not self._saving:
                raise KeyboardInterrupt
            self._sigint = True
        if self.received is None:
            self.received = signum

    def __call__(self, output: dict[str, Any]) -> None:
        if self._controller is None:
            return
        coordinator = getattr(self._controller, "coordinator", None)
        preempted = self.received is not None
        if coordinator is not None and coordinator.world_size > 1:
            preempted = coordinator.any(preempted)  # a signal to any rank preempts them all
        if not preempted:
            return
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        self._saving = True
        try:
            path = self._controller.save_checkpoint()
        finally:
            self._saving = False
        logger.warning("received %s: committed checkpoint %s at step %d", name, path, self._controller.global_step)
        if self.keep_running:
            self.received = None
            self._sigint = False
            return
        raise PreemptedExit(self.exit_code)

    def close(self) -> None:
        """Restore the signal handlers that were in place before :meth:`attach`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
