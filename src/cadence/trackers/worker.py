"""One tracker's thread: its calls run there in order, off the training thread (:class:`TrackerThread`)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Protocol

from cadence.errors import one_line

logger = logging.getLogger("cadence.trackers")

__all__ = ["MAX_QUEUED", "TrackerThread"]

MAX_QUEUED = 10_000
"""Calls queued for one tracker before new ones are dropped (a tracker that cannot keep up)."""


class Named(Protocol):
    name: str
    """Read at each warning: it may be set after construction."""


class TrackerThread:
    """One tracker's thread: runs its calls in order; the first failure turns it off, with one
    warning, and what is queued after it is dropped."""

    def __init__(self, tracker: Named) -> None:
        self.tracker = tracker
        self.failed = False
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._dropping = False
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failed or self._closed:
            return
        if self._queue.qsize() >= MAX_QUEUED:
            if not self._dropping:
                self._dropping = True
                logger.warning("tracker %s cannot keep up (%d calls queued): dropping what it is given until "
                               "it catches up", self.tracker.name, MAX_QUEUED)
            return
        self._dropping = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"cadence-tracker-{self.tracker.name}",
                                            daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.failed:
                continue
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # never into training: one warning, then off
                self.failed = True
                logger.warning("tracker %s failed and logs nothing more from this process (training goes on): %s",
                               self.tracker.name, one_line(e, limit=300))
                logger.debug("tracker %s failure", self.tracker.name, exc_info=True)

    def close(self, timeout: float) -> None:
        """Queue the end and wait up to ``timeout`` s for the thread to get there."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("tracker %s is still busy after %.0f s: leaving it (what it had not sent is lost)",
                           self.tracker.name, timeout)
