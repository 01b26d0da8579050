"""Hang detection (``trainer.hang_timeout``): a watchdog thread that ends a rank whose run makes no
progress -- a stuck collective, a dead data worker, a deadlock -- so that the launcher (torchrun,
with ``--max-restarts``) restarts the job from its last checkpoint instead of it waiting for ever.

The run reports progress on a :class:`Heartbeat`: the controller names the phase it enters
(``train``, ``evaluate``, ``checkpoint``, ``actions``, ``restore``) and the runners bump the beat
count at every training step and evaluation batch (an attribute increment: no lock, no clock on
the hot path). The :class:`Watchdog` polls the count; when it has not moved for ``timeout``
seconds it logs the phase, the step and the stack of the watched thread (and every thread's,
through :mod:`faulthandler`), then ends the process with :data:`HANG_EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from typing import Callable, Iterator

logger = logging.getLogger("cadence")

__all__ = ["HANG_EXIT_CODE", "Heartbeat", "Watchdog", "unwatched"]

HANG_EXIT_CODE = 124
"""The exit status of a rank ended by its watchdog (as ``timeout(1)``'s)."""


class Heartbeat:
    """Progress marks of a run: its phase, its global step and a count of beats."""

    __slots__ = ("phase", "step", "beats", "entered", "paused")

    def __init__(self) -> None:
        self.phase = "starting"
        self.step = 0
        self.beats = 0
        self.entered = 0  # the beat count when the phase was entered
        self.paused = 0  # > 0: inside work the watchdog does not time (see unwatched)

    def enter(self, phase: str, step: int | None = None) -> None:
        """The run enters ``phase`` (at ``step``): a beat too."""
        self.phase = phase
        if step is not None:
            self.step = step
        self.beats += 1
        self.entered = self.beats

    def position(self) -> str:
        """Where the run is, for a report: ``at step N`` -- in ``train`` the step of the loop's
        start plus the steps done since (one beat each), in ``evaluate`` with the batches done."""
        done = max(0, self.beats - self.entered)
        if self.phase == "train":
            return f"at step {self.step + done}"
        if self.phase == "evaluate":
            return f"at step {self.step}, after {done} evaluation batch{'' if done == 1 else 'es'}"
        return f"at step {self.step}"

    def beat(self) -> None:
        """One unit of progress (a training step, an evaluation batch)."""
        self.beats += 1


class Watchdog:
    """Ends the process when ``heartbeat`` does not beat for ``timeout`` seconds.

    ``thread``: the thread whose stack the report shows (default: the one creating the watchdog,
    the training thread). ``on_hang(report)``: what to do then (default: log the report, dump every
    thread's stack to stderr and ``os._exit(HANG_EXIT_CODE)`` -- an exit that no stuck thread can
    hold up). ``poll``: seconds between checks (default: ``timeout / 10``, at most 5 s). A context
    manager: started on entry, stopped on exit.
    """

    def __init__(self, heartbeat: Heartbeat, timeout: float, *, rank: int = 0,
                 on_hang: Callable[[str], None] | None = None, poll: float | None = None,
                 thread: threading.Thread | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"a watchdog's timeout must be > 0 seconds, got {timeout!r}")
        self.heartbeat = heartbeat
        self.timeout = float(timeout)
        self.rank = rank
        self._on_hang = on_hang if on_hang is not None else _exit_on_hang
        self._poll = poll if poll is not None else min(self.timeout / 10, 5.0)
        self._watched = thread if thread is not None else threading.current_thread()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Start watching (from now: the timeout runs from the start)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="cadence-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the run ended, or left the watched part)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def report(self, idle: float) -> str:
        """What the watchdog says when it fires after ``idle`` seconds without progress."""
        frame = sys._current_frames().get(self._watched.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (the thread has ended)\n"
        hb = self.heartbeat
        return (f"rank {self.rank}: no progress for {idle:.0f} s (trainer.hang_timeout={self.timeout:g}) in "
                f"phase {hb.phase!r} {hb.position()}; ending this rank (exit {HANG_EXIT_CODE}) so that the job "
                f"can restart from its last checkpoint. {self._watched.name} is at:\n{stack}")

    def _watch(self) -> None:
        last, since = self.heartbeat.beats, time.monotonic()
        while not self._stop.wait(self._poll):
            beats, now = self.heartbeat.beats, time.monotonic()
            if beats != last or self.heartbeat.paused:
                last, since = beats, now
            elif now - since >= self.timeout:
                self._on_hang(self.report(now - since))
                return


@contextlib.contextmanager
def unwatched(heartbeat: Heartbeat | None) -> Iterator[None]:
    """Work that the watchdog does not time, however long it takes: the Task building its inputs
    (a download, a dataset cache, on first use: possibly after the watchdog started). The timeout
    runs again from its end (no beat: the beats count the steps of a report's position).
    ``heartbeat`` None: no watchdog, nothing to do."""
    if heartbeat is None:
        yield
        return
    heartbeat.paused += 1
    try:
        yield
    finally:
        heartbeat.paused -= 1


EXIT_GRACE = 10.0
"""Seconds the report may take before the process ends anyway (writing it can block too: a stuck
thread may hold the logging handler's lock, or stderr may be a full pipe)."""


def _exit_on_hang(report: str) -> None:
    deadline = threading.Timer(EXIT_GRACE, os._exit, (HANG_EXIT_CODE,))
    deadline.daemon = True
    deadline.start()
    logger.error("%s", report)
    try:
        sys.stderr.write("cadence: all threads of the hung rank:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
    finally:
        os._exit(HANG_EXIT_CODE)
