"""torch's launcher's own lines about a failed rank, in the agent of ``cadence train --nproc N``
(:func:`hold_failure_lines`): dropped when the rank exited with status 2, where cadence's one line
says it for the job.

When a rank fails, torch's launcher logs, from ``torch.distributed.elastic.multiprocessing.api``,
one ``Sending process P closing signal SIGTERM`` per rank still running as it stops them, then
``failed (exitcode: N) local_rank: ...`` for the first failure. A rank refused by bad input
exits 2 and ``cadence train`` prints its one line (``cadence: error: ...``); for an exit status 2
of another cause it names the rank and the status itself (``cadence: failed: ...``). Other
failures keep torch's lines, in their order."""

from __future__ import annotations

import logging

__all__ = ["LAUNCHER_LOGGER", "FailureLines", "hold_failure_lines"]

LAUNCHER_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""The logger of torch's launcher that reports a failed rank."""

_STOPPING = "Sending process "
_FAILED = "failed (exitcode: "


class FailureLines(logging.Filter):
    """Holds the launcher's ``Sending process ... closing signal`` records until the next record:
    dropped with a ``failed (exitcode: 2)`` record (itself dropped too), let through before any
    other; a ``failed (exitcode: -N)`` record (a rank stopped by a signal, seen first when a peer's
    exit 2 raced it under load) is held with them until the agent's end. :meth:`release` lets the
    held ones through (the agent's end)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg if isinstance(record.msg, str) else ""
        if text.startswith(_STOPPING):
            self.held.append(record)
            return False
        if text.startswith(_FAILED) and isinstance(record.args, tuple) and record.args[:1] == (2,):
            self.held.clear()
            return False
        if text.startswith(_FAILED) and isinstance(record.args, tuple) and _signal(record.args[:1]):
            # the first failure it saw was a rank it stopped (a peer's exit 2 raced it): whether the job
            # ended on bad input is known at the agent's end (drop or release)
            self.held.append(record)
            return False
        self.release()
        return True

    def release(self) -> None:
        """Let the held records through, in order (past this filter: to the logger's handlers)."""
        held, self.held = self.held, []
        for record in held:
            self.logger.callHandlers(record)

    def drop(self) -> None:
        """Forget the held records (the job ended on bad input)."""
        self.held.clear()


def _signal(code: tuple[object, ...]) -> bool:
    """Whether a ``failed (exitcode: N)`` record's ``N`` is a signal (negative: a rank that was stopped)."""
    return bool(code) and isinstance(code[0], int) and code[0] < 0


def hold_failure_lines() -> FailureLines:
    """Install :class:`FailureLines` on torch's launcher logger (in the agent's process); returned
    for the agent to :meth:`~FailureLines.release` or :meth:`~FailureLines.drop` at its end."""
    logger = logging.getLogger(LAUNCHER_LOGGER)
    lines = FailureLines(logger)
    logger.addFilter(lines)
    return lines
