"""Save on preemption (Orbit's ``SaveCheckpointIfPreempted``), on SIGTERM as well as SLURM's SIGUSR1;
then, optionally, ask the scheduler to requeue the job (Slurm's ``scontrol requeue``)."""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any, Callable, Iterable

from cadence.errors import PreemptedExit
from cadence.extensions import RunContext
from cadence.runtime.signals import SignalHandlers, install_handlers, signal_name

logger = logging.getLogger("cadence.actions")

DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name)
)
REQUEUE_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1",) if hasattr(signal, name))

Requeue = Callable[[], "str | None"]
"""Asks the scheduler to requeue this job: None when it did, else why not (one line)."""


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

    ``requeue`` (e.g. :func:`cadence.cluster.slurm.requeue_job` of the job): when the signal was one
    of ``requeue_on`` (default SIGUSR1, Slurm's warning before the time limit; on any rank), the
    chief calls it once, after the commit, and the run exits with ``exit_code`` (also with
    ``keep_running``) -- unless the step saved is ``final_step`` or past it (training reached its end:
    nothing to come back for). A refusal is one warning line that says to resubmit the job. Once a
    requeue was asked for, every rank ignores SIGTERM after :meth:`close`: the scheduler ends a
    requeued job's processes, and these finish their clean exit instead (the scheduler's SIGKILL
    still ends one that hangs).

    Handlers can only be installed from the main thread; elsewhere a warning is logged and the
    action does nothing. :meth:`close` (called by ``Controller.close``, also when this action is
    wrapped in another, e.g. a :class:`~cadence.actions.ConditionalAction`) restores the previous
    handlers.
    """

    def __init__(
        self, signals: Iterable[int] = DEFAULT_SIGNALS, *, keep_running: bool = False, exit_code: int = 0,
        requeue: Requeue | None = None, requeue_on: Iterable[int] = REQUEUE_SIGNALS, final_step: int | None = None,
    ) -> None:
        self.signals = tuple(signals)
        self.keep_running = keep_running
        self.exit_code = exit_code
        self.requeue = requeue
        self.requeue_on = tuple(requeue_on)
        self.final_step = final_step
        self.requeued = False
        """Whether this process asked for the requeue (the chief, at most once)."""
        self._ignore_sigterm = False
        self.received: int | None = None
        self._sigint = False
        self._saving = False
        self._run: RunContext | None = None
        self._handlers: SignalHandlers | None = None

    @property
    def preempted(self) -> bool:
        """Whether a signal was received and not yet acted on."""
        return self.received is not None

    def attach(self, run: RunContext) -> None:
        self._run = run
        if self._handlers is not None:  # attached twice: keep the original handlers
            return
        self._handlers = install_handlers(self.signals, self._handle, owner="SaveCheckpointIfPreempted")
        if not self._handlers.installed:
            logger.warning("SaveCheckpointIfPreempted: not in the main thread; signal handlers not installed")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self._sigint and not self._saving:
                raise KeyboardInterrupt
            self._sigint = True
        if self.received is None:
            self.received = signum

    def __call__(self, output: dict[str, Any]) -> None:
        run = self._run
        if run is None:
            return
        preempted = self.received is not None
        if run.coordinator.world_size > 1:
            preempted = run.coordinator.any(preempted)  # a signal to any rank preempts them all
        if not preempted:
            return
        name = signal_name(self.received) if self.received is not None else "a signal on another rank"
        self._saving = True
        try:
            path = run.save_checkpoint()
            if run.checkpoint_manager is not None:
                run.checkpoint_manager.wait()  # an asynchronous save: committed before it is said to be
        finally:
            self._saving = False
        logger.warning("received %s: committed checkpoint %s at step %d", name, path, run.global_step)
        if self._requeue_wanted(run):
            if self.final_step is not None and run.global_step >= self.final_step:
                if run.coordinator.is_chief:
                    logger.warning("not requeueing the job: training reached its last step (%d); a new run only "
                                   "completes it (the final evaluation, FINAL)", run.global_step)
            else:
                self._ignore_sigterm = True
                if run.coordinator.is_chief and not self.requeued:
                    self._requeue(run.global_step)
            raise PreemptedExit(self.exit_code)
        if self.keep_running:
            self.received = None
            self._sigint = False
            return
        raise PreemptedExit(self.exit_code)

    def _requeue_wanted(self, run: RunContext) -> bool:
        """Collective when there is a ``requeue`` (several ranks): whether any rank got a ``requeue_on`` signal."""
        if self.requeue is None:
            return False
        wanted = self.received in self.requeue_on
        if run.coordinator.world_size > 1:
            wanted = run.coordinator.any(wanted)
        return wanted

    def _requeue(self, step: int) -> None:
        assert self.requeue is not None
        self.requeued = True
        refused = self.requeue()
        if refused is None:
            logger.warning("requeued the job: it resumes from the checkpoint at step %d", step)
        else:
            logger.warning("the job was not requeued (%s); resubmit the same batch script (sbatch ...) to resume "
                           "from the checkpoint at step %d", " ".join(refused.split()), step)

    def close(self) -> None:
        """Restore the signal handlers that were in place before :meth:`attach` (after a requeue, SIGTERM
        is ignored from here on)."""
        if self._handlers is not None:
            self._handlers.restore()
            self._handlers = None
        if self._ignore_sigterm:
            install_handlers([signal.SIGTERM], lambda *_: None, owner="SaveCheckpointIfPreempted")
