"""A process that ends when the process that started it dies.

Two users: ``cadence launch`` gives each child ``PR_SET_PDEATHSIG`` (SIGTERM) through a preexec
function (:func:`cadence.cluster.launch.die_with_parent`), and each worker of a torchrun job started
by cadence ends with its agent (:func:`die_with_agent`). torch's agent starts its workers in sessions
of their own, so a ``kill -9`` of the agent and its process group (a machine's processes ending, a
scheduler killing a job step) would leave them running as orphans: a "lost" node whose worker keeps
training with the others.

Linux only (``prctl``); elsewhere these do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from typing import Callable

__all__ = ["AGENT_PID_ENV", "die_with_agent", "parent_death_signal_setter"]

logger = logging.getLogger("cadence")

AGENT_PID_ENV = "CADENCE_TORCHRUN_AGENT"
"""The pid of the torchrun agent that started this worker (set by ``python -m cadence.cli.torchrun_agent``)."""

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None


def parent_death_signal_setter(signum: int) -> Callable[[], bool] | None:
    """A function that makes the calling process get ``signum`` when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``) and returns whether that took effect; ``None`` where there is no
    ``prctl``. Resolved here, so that the function itself only calls ``prctl`` (it may run in a
    forked child before ``exec``). The caller checks ``os.getppid()`` afterwards: a parent that died
    before the call is not signalled for."""
    prctl = _prctl()
    if prctl is None:
        return None
    signal_number = int(signum)

    def set_death_signal() -> bool:
        return prctl(_PR_SET_PDEATHSIG, signal_number, 0, 0, 0) == 0

    return set_death_signal


def die_with_agent() -> None:
    """In a worker of a torchrun job started by cadence (``$CADENCE_TORCHRUN_AGENT`` set): end this
    process with SIGKILL when that agent dies. (The variable stays: a ``cadence`` process this worker
    starts ends with the agent too.)

    When the agent is this process's parent, the kernel does it (``PR_SET_PDEATHSIG``); an agent
    that died before that took effect ends this process at once. When the parent is another process
    (a fork server, a wrapper script), a daemon thread checks every 0.2 s that the agent still runs
    (the same pid and start time)."""
    raw = os.environ.get(AGENT_PID_ENV, "")
    try:
        agent = int(raw)
    except ValueError:
        return
    if agent <= 1:
        return
    if os.getppid() == agent:
        setter = parent_death_signal_setter(signal.SIGKILL)
        if setter is not None and setter():
            if os.getppid() != agent:  # the agent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)
            return
    started = _start_time(agent)
    if started is None:  # no procfs, or the agent is already gone
        if not _alive(agent):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch, args=(agent, started), name="cadence-agent-watch", daemon=True).start()


def _watch(agent: int, started: str) -> None:
    while _start_time(agent) == started:
        threading.Event().wait(_POLL_S)
    logger.error("torchrun's agent (pid %d) is gone: ending this worker", agent)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (``/proc/PID/stat``), None when it does not run (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
