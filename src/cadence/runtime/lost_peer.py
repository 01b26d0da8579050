"""A rank whose collective failed only because another rank's process ended first.

When one rank of a torchrun job raises, its process exits and the others' next collective fails
("Connection closed by peer", gloo). Both then exit with status 1 within a fraction of a second,
and torchrun's launcher, which stamps failures to the second, may name the bystander as the job's
first failure. :func:`wait_for_the_launcher` lets the launcher see the rank that failed first:
a bystander waits (at most :data:`LAUNCHER_GRACE_S`) until the launcher stops it.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["LAUNCHER_GRACE_S", "PEER_LOST_MARKERS", "lost_a_peer", "wait_for_the_launcher"]

logger = logging.getLogger("cadence")

PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
"""What a collective's error says when another rank's process has ended (gloo's TCP transport)."""

LAUNCHER_GRACE_S = 5.0
"""The longest a bystander rank waits for the launcher to stop it (it polls ten times a second)."""


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective's failure because
    another rank's process ended."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(marker in str(current) for marker in PEER_LOST_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def wait_for_the_launcher(exc: BaseException, seconds: float = LAUNCHER_GRACE_S) -> None:
    """Under torchrun's launcher (``TORCHELASTIC_RUN_ID`` set), when ``exc`` says another rank's
    process ended: log one line and wait up to ``seconds``, so that the launcher observes the rank
    that failed first and stops this one; else return at once."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or not lost_a_peer(exc):
        return
    logger.error("rank %s: a collective failed because another rank's process ended; waiting for the launcher "
                 "to report that rank", os.environ.get("RANK", "?"))
    time.sleep(seconds)
