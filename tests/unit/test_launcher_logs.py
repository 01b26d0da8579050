"""torch's launcher's lines about a rank that exited 2 are left out, others kept in order
(:mod:`cadence.cli.launcher_logs`), on a real logger; a two-rank job: tests/processes/test_refused_runs.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from cadence.cli.launcher_logs import LAUNCHER_LOGGER, FailureLines, hold_failure_lines


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def launcher() -> Iterator[tuple[logging.Logger, FailureLines, Lines]]:
    logger = logging.getLogger(LAUNCHER_LOGGER)
    out = Lines()
    logger.addHandler(out)
    lines = hold_failure_lines()
    try:
        yield logger, lines, out
    finally:
        logger.removeFilter(lines)
        logger.removeHandler(out)


def stop_and_fail(logger: logging.Logger, code: int) -> None:
    """What torch's launcher logs when a rank fails: it stops the other, then names the first failure."""
    logger.warning("Sending process %s closing signal %s", 12, "SIGTERM")
    logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", code, 1, 13, "python")


def test_a_rank_that_exited_2_leaves_no_line(launcher):
    logger, lines, out = launcher
    stop_and_fail(logger, 2)
    lines.release()
    assert out.lines == []


def test_other_failures_keep_their_lines_in_order(launcher):
    logger, lines, out = launcher
    stop_and_fail(logger, 1)
    logger.warning("Sending process %s closing signal %s", 14, "SIGTERM")  # the agent stopped by a signal
    logger.warning("Received %s death signal, shutting down workers", "SIGTERM")
    logger.warning("Sending process %s closing signal %s", 15, "SIGKILL")
    assert out.lines == ["Sending process 12 closing signal SIGTERM",
                         "failed (exitcode: 1) local_rank: 1 (pid: 13) of binary: python",
                         "Sending process 14 closing signal SIGTERM",
                         "Received SIGTERM death signal, shutting down workers"]
    lines.release()  # the agent's end
    assert out.lines[-1] == "Sending process 15 closing signal SIGKILL"


def test_a_job_ended_by_bad_input_drops_what_is_held(launcher):
    logger, lines, out = launcher
    logger.warning("Sending process %s closing signal %s", 12, "SIGTERM")
    lines.drop()
    lines.release()
    assert out.lines == []


def test_a_stopped_rank_seen_first_is_held_until_the_job_ends(launcher):
    """Under load torch's launcher may name the rank it stopped (-15) as the first failure before the
    rank that exited 2: held until the agent's end, dropped when the job ended on bad input."""
    logger, lines, out = launcher
    stop_and_fail(logger, -15)
    assert out.lines == []
    lines.drop()  # bad input (the agent read the ranks' report)
    lines.release()
    assert out.lines == []
    stop_and_fail(logger, -15)
    lines.release()  # another failure: torch's lines, in order
    assert out.lines == ["Sending process 12 closing signal SIGTERM",
                         "failed (exitcode: -15) local_rank: 1 (pid: 13) of binary: python"]
