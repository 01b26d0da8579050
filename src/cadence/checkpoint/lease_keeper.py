"""A reader keeping its lease fresh from a background thread (see :mod:`cadence.checkpoint.leases`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from cadence.checkpoint.lease_file import Lease, check_after, check_holder, check_max_pending, check_reading, check_seconds
from cadence.checkpoint.leases import DEFAULT_LEASE_TTL, Leases

logger = logging.getLogger("cadence.checkpoint")


class _Unchanged:
    def __repr__(self) -> str:
        return "<unchanged>"


_UNCHANGED: Any = _Unchanged()


class LeaseKeeper:
    """Background thread that keeps a holder's lease fresh: rewrites it every ``renew_every``
    seconds with ``expires = now + ttl``, and immediately on :meth:`update`.

    Args:
      leases: where the lease lives.
      holder: the lease's holder name (``[A-Za-z0-9_.-]+``).
      ttl: seconds a written lease stays valid; a keeper that stops renewing (its process died
        or hangs) stops protecting anything at most ``ttl`` seconds after its last write.
      renew_every: seconds between renewals; default ``ttl / 4``. Must be less than ``ttl``.
      after, reading, max_pending: the initial protection (see :class:`Lease`).

    :meth:`start` writes the lease before it returns (raising when it cannot) and starts the
    thread. :meth:`update` writes synchronously: when ``update(reading=N)`` returns, N is protected
    on storage. A failed renewal is logged as a warning and retried at the next period; the thread
    never dies silently. :meth:`close` stops and joins the thread and releases the lease; it is
    idempotent. As a context manager the keeper starts on entry (unless started) and closes on exit.
    The thread is a daemon: a process that exits without :meth:`close` leaves its lease to expire.
    """

    def __init__(
        self,
        leases: Leases,
        holder: str,
        *,
        ttl: float = DEFAULT_LEASE_TTL,
        renew_every: float | None = None,
        after: int | None = None,
        reading: int | None = None,
        max_pending: int | None = None,
    ) -> None:
        self.leases = leases
        self.holder = check_holder(holder)
        self.ttl = check_seconds("ttl", ttl)
        self.renew_every = self.ttl / 4 if renew_every is None else check_seconds("renew_every", renew_every)
        if self.renew_every >= self.ttl:
            raise ValueError(f"renew_every ({self.renew_every}) must be less than ttl ({self.ttl}), or the lease lapses")
        self._after = check_after(after)
        self._reading = check_reading(reading)
        self._max_pending = check_max_pending(max_pending)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_due = 0.0  # time.monotonic() of the next renewal
        self._lease: Lease | None = None

    def __repr__(self) -> str:
        return (
            f"LeaseKeeper({self.holder!r}, after={self._after}, reading={self._reading}, "
            f"max_pending={self._max_pending}, ttl={self.ttl})"
        )

    @property
    def after(self) -> int | None:
        return self._after

    @property
    def reading(self) -> int | None:
        return self._reading

    @property
    def max_pending(self) -> int | None:
        return self._max_pending

    @property
    def lease(self) -> Lease | None:
        """The lease last written successfully (None before the first write)."""
        return self._lease

    def start(self) -> LeaseKeeper:
        """Write the lease now (storage errors propagate) and start renewing it; return self.

        Raises ``RuntimeError`` when already started or closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._thread is not None:
                raise RuntimeError(f"{self!r} is already started")
            self._write()
            self._thread = threading.Thread(target=self._run, name=f"cadence-lease-{self.holder}", daemon=True)
            self._thread.start()
        return self

    def update(self, *, after: Any = _UNCHANGED, reading: Any = _UNCHANGED, max_pending: Any = _UNCHANGED) -> None:
        """Change what the lease protects (fields not passed are unchanged; pass None to clear
        one) and write it at once.

        Before :meth:`start` this only sets the values. Once started, the lease is on storage when
        this returns; when the write fails the error propagates (the new values are kept and the
        next renewal retries them). Raises ``ValueError`` for a bad step, ``RuntimeError`` after
        :meth:`close`.
        """
        new_after = self._after if after is _UNCHANGED else check_after(after)
        new_reading = self._reading if reading is _UNCHANGED else check_reading(reading)
        new_max = self._max_pending if max_pending is _UNCHANGED else check_max_pending(max_pending)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            self._after, self._reading, self._max_pending = new_after, new_reading, new_max
            if self._thread is not None:
                self._write()

    def close(self, release: bool = True) -> None:
        """Stop and join the thread, then (``release=True``) remove the lease. Idempotent.

        A failure to remove the lease is logged; the lease then expires on its own.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if release and thread is not None:
            try:
                self.leases.release(self.holder)
            except Exception as e:  # noqa: BLE001 - the lease expires anyway
                logger.warning("could not release lease %r (it expires on its own within %gs): %s", self.holder, self.ttl, e)

    def __enter__(self) -> LeaseKeeper:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _write(self) -> None:
        """Write the lease; the caller holds the lock. The next renewal is due a period later,
        whether or not this write succeeded (a failure is retried then)."""
        self._next_due = time.monotonic() + self.renew_every
        self._lease = self.leases.write(
            self.holder, after=self._after, reading=self._reading, ttl=self.ttl, max_pending=self._max_pending
        )

    def _run(self) -> None:
        try:
            with self._lock:
                while True:
                    remaining = self._next_due - time.monotonic()
                    while not self._closed and remaining > 0:
                        self._lock.wait(remaining)
                        remaining = self._next_due - time.monotonic()
                    if self._closed:
                        return
                    try:
                        self._write()
                    except Exception as e:  # noqa: BLE001 - retried next period
                        lapse = self._lease.expires if self._lease is not None else time.time()
                        logger.warning(
                            "could not renew lease %r (retrying in %gs; it lapses at %s unless renewed): %s",
                            self.holder, self.renew_every, time.strftime("%H:%M:%S", time.localtime(lapse)), e,
                        )
        except BaseException:  # pragma: no cover - a bug: never die silently
            logger.error("lease keeper thread for %r died; the lease will expire", self.holder, exc_info=True)
            raise
