"""Readers' leases: checkpoints a reader (a sidecar evaluator) needs are not deleted by retention.

A reader keeps one small JSON file per holder, ``checkpoints/.leases/<holder>.json``::

    {"holder": "eval", "after": 200, "reading": 200, "max_pending": null,
     "expires": 1700000060.0, "pid": 1234, "host": "node-3", "time": 1700000000.0}

While unexpired -- judged by the **writer's** wall clock -- the lease protects from retention

* the checkpoint ``reading`` (when not null), and
* every committed step ``> after`` (when ``after`` is not null): a *range*. Checkpoints committed
  after the reader last looked are protected from the moment they appear, so a reader that
  evaluates every checkpoint in order never races the writer to discover them. With
  ``max_pending`` (optional, an int >= 1) the range is bounded: only the newest ``max_pending``
  committed steps ``> after`` are protected, so a reader that falls behind cannot make the writer
  keep an unbounded number of checkpoints; the older ones are left to retention (the reader
  records them as skipped).

``after: -1`` protects every checkpoint (a reader that has evaluated nothing yet);
``after: null`` protects no range: a reader that only wants the newest checkpoint protects just
what it reads. Expired leases protect nothing: a reader that died (even by ``kill -9``) stops
holding checkpoints back at most ``ttl`` seconds later (``ttl`` + :data:`CLOCK_SKEW_TOLERANCE`
for a reader on another host).

Clocks. ``expires`` is the reader's wall clock; the writer compares it with its own. A lease
written on another host (its ``host`` differs from this one's name) counts
:data:`CLOCK_SKEW_TOLERANCE` seconds longer (:func:`clock_skew`), and a reader renews every
``ttl / 4``: so a reader's clock may lag the writer's by up to ``3/4 ttl`` + that tolerance
before its lease lapses while it lives. Same host, same clock: no tolerance.

What the protocol guarantees. The writer reads the leases, then deletes what is unprotected (the
manifest first). A step is therefore safe to read when it was protected *before* the reader
listed it: steps ``> after`` of a lease that already existed, or a ``reading`` step the reader
already held. Protection handed over in one write -- ``update(after=None, reading=N)`` while
``after < N`` was in place -- is continuous. A reader that first writes ``reading=N`` for a step
it just listed (with no range covering it) may still lose it to a retention pass already under
way, and must tolerate the checkpoint vanishing (:class:`~cadence.errors.CheckpointError`); the
same holds for steps that existed before a brand-new lease was first written, and for steps that
drop out of a bounded (``max_pending``) range as newer ones are committed.

Writes are atomic (:meth:`cadence.storage.Storage.write_atomic`), so a reader killed while writing
leaves its previous lease or the new one, never a torn file. Files that cannot be parsed anyway
(other tools, other stores) are skipped with a warning: a broken reader never stops the trainer.

:class:`Leases` reads and writes the files; :class:`LeaseKeeper` keeps one holder's lease fresh
from a background thread. :class:`~cadence.checkpoint.CheckpointManager` honours the leases in
its directory automatically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

DEFAULT_LEASE_TTL = 60.0
"""Seconds a lease lives without renewal unless told (``sidecar.lease_ttl``'s default too)."""

LEASES_DIR = ".leases"
"""The directory (inside the checkpoints directory) holding the lease files; not a checkpoint."""

_HOLDER = re.compile(r"[A-Za-z0-9_.-]+")
_SUFFIX = ".json"
_TEMP = re.compile(r".+\.tmp-[0-9a-f]+")  # Storage.write_atomic's temp files
_LEFTOVER_MIN_AGE = 60.0  # a temp or unparsable file younger than this may be a write in flight

CLOCK_SKEW_TOLERANCE = 10.0
"""Seconds by which the wall clocks of two hosts sharing a model dir may differ: an expiry time
written on another host is trusted only this much later (readers' leases here, the writer lease
in :mod:`cadence.checkpoint.writer_lease`)."""


def clock_skew(host: str) -> float:
    """The tolerance to add to an expiry time written on ``host``: 0 for this host (one clock),
    :data:`CLOCK_SKEW_TOLERANCE` for any other, or an unknown (``""``) one."""
    return 0.0 if host and host == socket.gethostname() else CLOCK_SKEW_TOLERANCE


def check_holder(holder: object) -> str:
    """Return ``holder`` when it is a valid holder name (``[A-Za-z0-9_.-]+``), else raise ``ValueError``."""
    if not isinstance(holder, str) or not _HOLDER.fullmatch(holder):
        raise ValueError(f"a lease holder name is a non-empty string of letters, digits, '_', '.' and '-', got {holder!r}")
    return holder


def _check_step(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"lease {name} must be None or an int >= 0, got {value!r}")
    return value


def _check_after(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"lease after must be None or an int >= -1 (-1: every step), got {value!r}")
    return value


def _check_max_pending(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"lease max_pending must be None or an int >= 1, got {value!r}")
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Lease:
    """One reader's lease, as read from (or written to) ``.leases/<holder>.json``.

    Attributes:
      holder: the reader's name (also the file name).
      after: protect every step ``> after`` (-1: every step); None: no range.
      reading: protect this step; None: none.
      max_pending: with ``after``, protect only the newest ``max_pending`` steps ``> after``;
        None: all of them (the last field, with a default: files and callers without it still work).
      expires: unix time (the writer's clock decides) after which the lease protects nothing.
      pid, host: the process that wrote it (for people and tools; never used to decide anything).
      time: unix time of the write.
    """

    holder: str
    after: int | None
    reading: int | None
    expires: float
    pid: int
    host: str
    time: float
    max_pending: int | None = None

    def protects(self, steps: Iterable[int]) -> set[int]:
        """The steps among ``steps`` this lease protects: ``reading``, and those ``> after`` (only
        the newest ``max_pending`` of them when it is set).

        Expiry is not considered here (see :meth:`expired` and :meth:`Leases.active`).
        """
        steps = set(steps)
        protected = {self.reading} & steps if self.reading is not None else set()
        if self.after is not None:
            later = sorted(step for step in steps if step > self.after)
            if self.max_pending is not None:
                later = later[-self.max_pending :]
            protected.update(later)
        return protected

    def expired(self, now: float) -> bool:
        """True when the lease has ended at unix time ``now`` (``now >= expires``)."""
        return now >= self.expires

    def to_json(self) -> bytes:
        """The file's contents."""
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, holder: str) -> Lease:
        """Parse a lease file's contents; ``holder`` is the file's holder name (authoritative).

        ``after``, ``reading`` and ``expires`` must be valid (they decide what is protected), and
        ``max_pending`` when present; missing or mistyped ``pid`` / ``host`` / ``time`` are filled with 0 / "" / 0.0.
        Raises ``ValueError`` on anything else.
        """
        document = json.loads(data)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        for key in ("after", "reading", "expires"):
            if key not in document:
                raise ValueError(f"no {key!r}")
        expires = document["expires"]
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise ValueError(f"'expires' is not a finite number: {expires!r}")
        pid, host, when = document.get("pid"), document.get("host"), document.get("time")
        return cls(
            holder=holder,
            after=_check_after(document["after"]),
            reading=_check_step("reading", document["reading"]),
            max_pending=_check_max_pending(document.get("max_pending")),
            expires=float(expires),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
            host=host if isinstance(host, str) else "",
            time=float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else 0.0,
        )


class Leases:
    """The leases of the checkpoints in ``checkpoints_dir`` (a local path or an fsspec URL).

    Readers call :meth:`write` / :meth:`release` (or use a :class:`LeaseKeeper`); the writer calls
    :meth:`protected_steps` at each retention pass and :meth:`remove_expired` at start-up. Nothing
    is created until the first :meth:`write`.
    """

    def __init__(self, checkpoints_dir: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.checkpoints_dir = checkpoints_dir
        self.storage = Storage(checkpoints_dir, storage_options)
        self.root = self.storage.join(LEASES_DIR)

    def __repr__(self) -> str:
        return f"Leases({self.storage.url(self.root)!r})"

    def path(self, holder: str) -> str:
        """Where ``holder``'s lease file lives (a file-system path of :attr:`storage`)."""
        return self.storage.join(LEASES_DIR, check_holder(holder) + _SUFFIX)

    # -- reader side ---------------------------------------------------------------------------

    def write(
        self, holder: str, *, after: int | None, reading: int | None, ttl: float, max_pending: int | None = None
    ) -> Lease:
        """Atomically write (create or replace) ``holder``'s lease, expiring ``ttl`` seconds from now.

        Creates ``.leases/`` when needed. When this returns, the lease is on storage. Raises
        ``ValueError`` for a bad holder name, step or ttl; storage errors propagate.
        """
        path = self.path(holder)
        now = time.time()
        lease = Lease(
            holder=holder,
            after=_check_after(after),
            reading=_check_step("reading", reading),
            max_pending=_check_max_pending(max_pending),
            expires=now + _check_seconds("ttl", ttl),
            pid=os.getpid(),
            host=socket.gethostname(),
            time=now,
        )
        self.storage.makedirs(self.root)
        self.storage.write_atomic(path, lease.to_json())
        return lease

    def release(self, holder: str) -> None:
        """Remove ``holder``'s lease; nothing happens when there is none."""
        try:
            self.storage.remove(self.path(holder))
        except FileNotFoundError:
            pass

    # -- writer side ---------------------------------------------------------------------------

    def read_all(self) -> list[Lease]:
        """Every lease on storage, expired or not, sorted by holder.

        One listing of ``.leases/`` and one small read per lease file. Files that cannot be read
        or parsed are skipped with a warning; a file removed while listing is skipped silently;
        temp files of writes in flight are ignored. A failure to list ``.leases/`` itself
        propagates (the caller cannot know what is protected). No ``.leases/``: no leases.
        """
        leases = []
        for name, holder in self._lease_files():
            path = self.storage.join(LEASES_DIR, name)
            try:
                leases.append(Lease.from_json(self.storage.read_bytes(path), holder))
            except FileNotFoundError:
                continue  # released between the listing and the read
            except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                logger.warning("ignoring unreadable lease file %s: %s", self.storage.url(path), e)
        return sorted(leases, key=lambda lease: lease.holder)

    def active(self, now: float | None = None) -> list[Lease]:
        """The unexpired leases at unix time ``now`` (default: this machine's clock); a lease
        written on another host is given :data:`CLOCK_SKEW_TOLERANCE` more (:func:`clock_skew`)."""
        now = time.time() if now is None else now
        return [lease for lease in self.read_all() if not lease.expired(now - clock_skew(lease.host))]

    def protected_steps(self, steps: Iterable[int], now: float | None = None) -> set[int]:
        """The steps among ``steps`` protected by an unexpired lease at ``now`` (default: now).

        Raises when ``.leases/`` cannot be listed; the caller should then delete nothing.
        """
        steps = list(steps)
        protected: set[int] = set()
        for lease in self.active(now):
            protected |= lease.protects(steps)
        return protected

    def remove_expired(self, grace: float = 0.0, now: float | None = None) -> list[str]:
        """Remove the files of leases expired for more than ``grace`` seconds; return their names.

        For the writer, to clean up after dead readers; unexpired leases are never touched (each
        file is read again just before it is removed). Also removed: unparsable lease files and
        temp files of interrupted writes whose modification time is more than ``max(grace, 60)``
        seconds old (never younger ones: they may be writes in flight). Failures to remove are
        logged and skipped. Returns the base names of the removed files.
        """
        now = time.time() if now is None else now
        removed = []
        for name in self.storage.listdir(self.root):
            path = self.storage.join(LEASES_DIR, name)
            try:
                if not self._removable(name, path, grace, now):
                    continue
                self.storage.remove(path)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - clean-up must not stop the writer
                logger.warning("could not remove stale lease file %s: %s", self.storage.url(path), e)
                continue
            logger.info("removed stale lease file %s", self.storage.url(path))
            removed.append(name)
        return removed

    def _removable(self, name: str, path: str, grace: float, now: float) -> bool:
        holder = self._holder_of(name)
        if holder is not None:
            try:
                lease = Lease.from_json(self.storage.read_bytes(path), holder)
            except ValueError:
                return self._old(path, grace, now)
            return lease.expired(now - grace - clock_skew(lease.host))
        if _TEMP.fullmatch(name) and self._holder_of(name.rsplit(".tmp-", 1)[0]) is not None:
            return self._old(path, grace, now)
        return False  # not ours

    def _old(self, path: str, grace: float, now: float) -> bool:
        mtime = self.storage.mtime(path)
        return mtime is not None and now - mtime > max(grace, _LEFTOVER_MIN_AGE)

    def _lease_files(self) -> list[tuple[str, str]]:
        files = []
        for name in self.storage.listdir(self.root):
            holder = self._holder_of(name)
            if holder is not None:
                files.append((name, holder))
        return files

    @staticmethod
    def _holder_of(name: str) -> str | None:
        if not name.endswith(_SUFFIX):
            return None
        holder = name[: -len(_SUFFIX)]
        return holder if _HOLDER.fullmatch(holder) else None


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
        self.ttl = _check_seconds("ttl", ttl)
        self.renew_every = self.ttl / 4 if renew_every is None else _check_seconds("renew_every", renew_every)
        if self.renew_every >= self.ttl:
            raise ValueError(f"renew_every ({self.renew_every}) must be less than ttl ({self.ttl}), or the lease lapses")
        self._after = _check_after(after)
        self._reading = _check_step("reading", reading)
        self._max_pending = _check_max_pending(max_pending)
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
        new_after = self._after if after is _UNCHANGED else _check_after(after)
        new_reading = self._reading if reading is _UNCHANGED else _check_step("reading", reading)
        new_max = self._max_pending if max_pending is _UNCHANGED else _check_max_pending(max_pending)
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
