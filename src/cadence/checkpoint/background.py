"""A worker thread for checkpoint I/O helpers (hashing, fsync) that keeps working while the
interpreter exits.

``concurrent.futures`` executors refuse new work once interpreter shutdown has begun, which is
exactly when an asynchronous checkpoint commit is still being written (the process waits for it
before exiting). A :class:`Worker` is a daemon thread fed by a queue: it runs calls in submission
order, and stays usable until the last non-daemon thread is done.

The threads doing checkpoint I/O in the background run at a lower CPU priority
(:func:`yield_cpu`), so that under contention the training thread goes first.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger("cadence.checkpoint")

BACKGROUND_NICE = 10
"""How much nicer (Linux ``nice``) than the training thread a background checkpoint thread runs."""


def yield_cpu() -> None:
    """Lower the calling thread's CPU priority by :data:`BACKGROUND_NICE` (Linux, where ``nice``
    is per thread; elsewhere nothing, as it would apply to the whole process). Under CPU
    contention the training thread then runs first; an idle core is used all the same."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError as e:  # a sandbox without setpriority: full priority, as before
        logger.debug("could not lower a background thread's priority: %s", e)


class Pending:
    """The outcome of a call submitted to a :class:`Worker`."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._error = e
        finally:
            self._done.set()

    @classmethod
    def done(cls, value: Any) -> Pending:
        """An outcome already known: ``value``."""
        pending = cls(lambda: value, ())
        pending._run()
        return pending

    def wait(self) -> None:
        """Wait for the call, ignoring its outcome."""
        self._done.wait()

    def result(self) -> Any:
        """Wait for the call; return its value or raise its exception."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Worker:
    """One daemon thread running submitted calls in order (started on first use, and again after
    a fork)."""

    def __init__(self, name: str, *, lower_priority: bool = True) -> None:
        self.name = name
        self.lower_priority = lower_priority  # False: at the training thread's priority (work it waits for)
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread now, if it is not running. A thread takes the CPU priority of the thread
        that starts it: a worker at the training thread's priority must be started from it (not from
        a lowered writer thread that submits to it first)."""
        with self._lock:
            self._running()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        with self._lock:
            pending = Pending(fn, args)
            self._running().put(pending)
        return pending

    def _running(self) -> queue.SimpleQueue[Pending]:
        """The queue of the running thread, started (again: after a fork) when there is none."""
        if self._thread is None or not self._thread.is_alive():
            self._queue = queue.SimpleQueue()  # after a fork, the old queue belongs to no thread
            self._thread = threading.Thread(target=self._serve, args=(self._queue, self.lower_priority),
                                            name=self.name, daemon=True)
            self._thread.start()
        return self._queue

    @staticmethod
    def _serve(tasks: queue.SimpleQueue[Pending], lower_priority: bool) -> None:
        if lower_priority:
            yield_cpu()
        while True:
            tasks.get()._run()


class Workers:
    """``size`` :class:`Worker` threads sharing the calls submitted, round robin: up to ``size`` run
    at once. For fsyncs: issued together, they reach the disk in one journal commit rather than
    one after the other."""

    def __init__(self, name: str, size: int) -> None:
        self._workers = [Worker(f"{name}-{i}") for i in range(size)]
        self._turn = itertools.count()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        return self._workers[next(self._turn) % len(self._workers)].submit(fn, *args)


class BackgroundSave:
    """An asynchronous checkpoint save: at most one in flight, on a thread that is not a daemon
    (interpreter exit waits for its commit) and runs at a lower priority (:func:`yield_cpu`). Its
    failure is kept until taken (:meth:`take_error`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, name: str, save: Callable[[], object]) -> None:
        """Run ``save()`` on a new thread called ``name``; the caller has :meth:`join`-ed the last one."""

        def run() -> None:
            yield_cpu()  # training goes first when the two compete for a core
            try:
                save()
            except BaseException as e:  # noqa: BLE001 - surfaced by take_error()
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=False)
        self._thread.start()

    def join(self) -> None:
        """Wait for the save in flight, if any (its failure stays for :meth:`take_error`)."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def take_error(self) -> BaseException | None:
        """The failure of a finished save, once (None when there is none); does not block."""
        error, self._error = self._error, None
        return error
