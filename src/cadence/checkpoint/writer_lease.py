"""The writer lease: one trainer writes a model dir at a time (docs/design.md, "One writer per model dir").

Each acquisition is one small JSON file in ``MODEL_DIR/.writer/``, named by its *fencing token*,
an integer that only grows::

    .writer/lease-000000000007.json
    {"token": 7, "host": "node-3", "pid": 1234, "pid_namespace": "pid:[4026531836]", "job": null,
     "since": 1700000000.0, "renewed": 1700000045.0, "expires": 1700000105.0, "released": false}

The file with the highest token is the **current** lease. The contract:

* **Acquire** (:meth:`WriterLease.acquire`): read the current lease. When it is *held* --
  not released, not expired by this process's clock, and its holder not replaceable -- raise
  :class:`~cadence.errors.WriterLeaseHeldError` naming the holder (host, pid, since), unless
  taking over (see *replaceable*). Otherwise create ``lease-<token + 1>.json`` *exclusively*
  (:meth:`~cadence.storage.Storage.create_exclusive`): of trainers acquiring at once exactly one
  succeeds; the others read the winner's lease and refuse.
* **Replaceable** although held: the holder is this process (a newer acquisition in one process
  fences off the older); or it ran on this host, in this pid namespace, and its pid is gone
  (``kill -9`` and restart on one machine takes over at once); or it belongs to the same *job*
  (``CADENCE_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``) and the same replica *group*: a
  restarted job takes over from its own earlier attempt, whose workers torchelastic stopped first.
  On another host a dead holder's lease ends when it expires, ``ttl`` seconds after its last renewal.
* **Replica groups** (``trainer.fault_tolerance``) share the run's model dir: each acquires with its
  ``group`` name, recorded in the lease. The holder commits; the others stand by
  (:class:`~cadence.checkpoint.writer_turn.WriterTurn`) and try to acquire, without waiting, at
  each checkpoint: they succeed by the rules above once the holder is gone. Two groups of one job are
  not the same holder (a live peer group is never replaced).
* **Renew**: a daemon thread rewrites the holder's own file every ``ttl / 4`` seconds with
  ``expires = now + ttl``. Only the holder writes its file; a newcomer writes a new token.
* **Fence** (:meth:`WriterLease.check`): before each commit, deletion and FINAL the
  :class:`~cadence.checkpoint.CheckpointManager` calls ``check``; it raises
  :class:`~cadence.errors.WriterLeaseLostError` when a higher token exists (taken over), the lease
  was released, or the holder's own last successful renewal is ``ttl`` seconds old or more (a
  holder that could not renew stops by its own clock, before a newcomer may take over by its).
  Storage has no compare-and-swap on a commit: a commit already past its check completes; a
  takeover waits for expiry (or ``--take-over``), so only a holder hung between its check and its
  manifest rename through a whole ``ttl`` could commit after a takeover.
* **Take over** (:func:`take_over`, ``cadence train --take-over``): write the next token as a
  released lease. The old holder is fenced off at its next check; the next trainer acquires.
* **Release** (:meth:`WriterLease.release`): mark the holder's file released; the next trainer
  acquires at once. Files older than the previous lease are then removed (the previous one is
  kept: who held the model dir before).
* **Withdraw** (:meth:`WriterLease.withdraw`, a run refused before it changed anything): remove
  the holder's own file instead, as if it had never acquired. Safe because tokens are compared,
  never remembered: the previous lease is the current one again, and it was free when this one
  was taken (released, expired, or its holder gone) -- a released or taken-over lease stays
  free, and the holder of an expired one is fenced by its own ttl unless it renews with no newer
  token there, exactly as if this acquisition had never happened. The withdrawing process has
  stopped renewing and commits nothing more (its token may be handed out again), and it wrote
  nothing that carries its token (a checkpoint's claim) that outlives the run.

Clocks. ``expires`` is the holder's wall clock, read by another process. On the holder's own
host that is one clock. A lease written on another host counts as held until ``expires`` +
:data:`~cadence.checkpoint.lease_file.CLOCK_SKEW_TOLERANCE` (10 s) by the reader's clock, while the
holder fences itself by its own monotonic clock ``ttl`` after its last renewal: a newcomer whose
clock runs up to that tolerance ahead of the holder's still takes over only after the holder has
stopped committing. A larger skew lets a newcomer take over up to (skew - tolerance) seconds
before the holder stops, whatever the ``ttl``: keep the hosts' clocks synchronized (NTP).
Ranks of one job share the job's lease: only the chief acquires it and commits.
Readers (sidecars, ``evaluate``, ``export``, ``ls``) never need it.
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
from dataclasses import asdict, dataclass, replace
from typing import Any

from cadence import layout
from cadence.checkpoint.lease_file import clock_skew, zombie
from cadence.checkpoint.space import space_cause
from cadence.errors import WriterLeaseHeldError, WriterLeaseLostError
from cadence.storage import Storage

__all__ = ["DEFAULT_WRITER_LEASE_TTL", "WriterLease", "WriterLeaseRecord", "check_free", "current_lease", "lease_path",
           "read_lease", "take_over"]

logger = logging.getLogger("cadence.checkpoint")

DEFAULT_WRITER_LEASE_TTL = 60.0
"""Seconds a writer lease lives without renewal (``checkpoint.writer_lease_ttl``'s default)."""

_FILE = re.compile(r"lease-(\d+)\.json")
JOB_ENV = ("CADENCE_JOB_ID", "TORCHELASTIC_RUN_ID")
"""Environment variables naming the job, first set wins (torchrun's ``none`` does not count)."""


def _file_name(token: int) -> str:
    return f"lease-{token:012d}.json"


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _job_id() -> str | None:
    for name in JOB_ENV:
        value = os.environ.get(name, "").strip()
        if value and value.lower() != "none":
            return value
    return None


def _utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


@dataclass(frozen=True)
class WriterLeaseRecord:
    """One acquisition of the writer lease, as stored in ``.writer/lease-<token>.json``.

    Attributes:
      token: the fencing token: higher than every earlier acquisition's.
      host, pid, pid_namespace: the holder process (the namespace tells containers on one host apart).
      job: the holder's job id (see :data:`JOB_ENV`); None outside a named job.
      since: unix time of the acquisition; renewed: of the last renewal.
      expires: unix time after which the lease is free (unless renewed).
      released: the holder let it go (or it was taken over): free at once.
      group: the holder's replica group (``group<r>``) when the model dir is shared by replica
        groups; None for a plain trainer.
    """

    token: int
    host: str
    pid: int
    pid_namespace: str | None
    job: str | None
    since: float
    renewed: float
    expires: float
    released: bool = False
    group: str | None = None

    def to_json(self) -> bytes:
        doc = asdict(self)
        if self.group is None:  # a plain trainer's lease reads as before replica groups
            del doc["group"]
        return (json.dumps(doc, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, token: int) -> WriterLeaseRecord:
        """Parse a lease file; ``token`` (from the file name) is authoritative. ValueError when a
        field that decides anything (``expires``, ``released``) is missing or mistyped."""
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        expires, released = doc.get("expires"), doc.get("released", False)
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise ValueError(f"'expires' is not a finite number: {expires!r}")
        if not isinstance(released, bool):
            raise ValueError(f"'released' is not a boolean: {released!r}")

        def text(key: str) -> str | None:
            value = doc.get(key)
            return value if isinstance(value, str) else None

        def number(key: str) -> float:
            value = doc.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

        pid = doc.get("pid")
        return cls(token=token, host=text("host") or "", pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
                   pid_namespace=text("pid_namespace"), job=text("job"), since=number("since"),
                   renewed=number("renewed"), expires=float(expires), released=released,
                   group=text("group"))

    def held(self, now: float) -> bool:
        """Not released and not expired at unix time ``now`` (this host's clock): ``expires``, plus
        :data:`~cadence.checkpoint.lease_file.CLOCK_SKEW_TOLERANCE` when written on another host."""
        return not self.released and now < self.expires + clock_skew(self.host)

    def replaceable(self, group: str | None = None) -> bool:
        """True when this process (of replica group ``group``; None: a plain trainer) may take the
        lease over although it is held (see the module doc): the holder is this very process (the
        newer acquisition wins, the older is fenced off), or is gone: same host and pid namespace
        with its pid not running, or the same job and group."""
        job = _job_id()
        if job is not None and job == self.job and group == self.group:
            return True
        if self.host != socket.gethostname() or self.pid_namespace != _pid_namespace() or self.pid <= 0:
            return False
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: it runs, as another user
            return False
        return zombie(self.pid)

    def describe(self, now: float) -> str:
        who = f"replica {self.group}, " if self.group is not None else ""
        return (f"{who}pid {self.pid} on host {self.host or '?'} since {_utc(self.since)} "
                f"(writer lease {self.token}, expires in {max(0.0, self.expires + clock_skew(self.host) - now):.0f}s)")


class _Dir:
    """The lease files of one model dir."""

    def __init__(self, model_dir: str, storage_options: dict[str, Any] | None) -> None:
        self.model_dir = model_dir
        self.storage = Storage(layout.writer_lease_dir(model_dir), storage_options)

    def tokens(self) -> list[int]:
        """Every token with a file, ascending."""
        if not self.storage.isdir(self.storage.root):
            return []
        found = (_FILE.fullmatch(name) for name in self.storage.listdir(self.storage.root))
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, token: int) -> str:
        return self.storage.join(_file_name(token))

    def read(self, token: int) -> WriterLeaseRecord:
        """The lease of ``token``; one that cannot be read or parsed counts as held until its file
        is ``DEFAULT_WRITER_LEASE_TTL`` seconds old (a write in flight, or another tool's file)."""
        path = self.path(token)
        try:
            return WriterLeaseRecord.from_json(self.storage.read_bytes(path), token)
        except (OSError, ValueError) as e:
            written = self.storage.mtime(path) or time.time()
            logger.warning("unreadable writer lease %s (%s); treating it as held until %s", self.storage.url(path),
                           e, _utc(written + DEFAULT_WRITER_LEASE_TTL))
            return WriterLeaseRecord(token, "?", 0, None, None, written, written, written + DEFAULT_WRITER_LEASE_TTL)

    def current(self) -> WriterLeaseRecord | None:
        tokens = self.tokens()
        return self.read(tokens[-1]) if tokens else None

    def create(self, record: WriterLeaseRecord) -> bool:
        self.storage.makedirs(self.storage.root)
        return self.storage.create_exclusive(self.path(record.token), record.to_json())

    def prune(self, below: int) -> None:
        """Remove the files of tokens below ``below`` (best effort)."""
        for token in self.tokens():
            if token < below:
                try:
                    self.storage.remove(self.path(token))
                except OSError as e:
                    logger.debug("could not remove old writer lease %d: %s", token, e)


def _record(token: int, ttl: float, *, released: bool = False, group: str | None = None) -> WriterLeaseRecord:
    now = time.time()
    return WriterLeaseRecord(token=token, host=socket.gethostname(), pid=os.getpid(), pid_namespace=_pid_namespace(),
                             job=_job_id(), since=now, renewed=now, expires=now if released else now + ttl,
                             released=released, group=group)


def current_lease(model_dir: str, *, storage_options: dict[str, Any] | None = None) -> WriterLeaseRecord | None:
    """The model dir's current writer lease (held or not); None when it never had one."""
    return _Dir(model_dir, storage_options).current()


def lease_path(token: int) -> str:
    """The file of lease ``token``, relative to the model dir: ``.writer/lease-<token>.json``."""
    return f"{layout.WRITER}/{_file_name(token)}"


def read_lease(model_dir: str, token: int, *, storage_options: dict[str, Any] | None = None) -> WriterLeaseRecord:
    """The lease file of ``token`` as this process sees it. Raises ``FileNotFoundError`` when there is
    none, ``OSError`` when it cannot be read and ``ValueError`` when it does not parse (no fallback:
    a check of what another process wrote, see :mod:`cadence.checkpoint.shared_dir`)."""
    directory = _Dir(model_dir, storage_options)
    return WriterLeaseRecord.from_json(directory.storage.read_bytes(directory.path(token)), token)


def check_free(model_dir: str, *, storage_options: dict[str, Any] | None = None,
               group: str | None = None) -> None:
    """Raise :class:`~cadence.errors.WriterLeaseHeldError` when another live process holds
    ``model_dir``'s writer lease (a check before starting a job's ranks; only
    :meth:`WriterLease.acquire` takes the lease). ``group``: this job is that replica group, which
    stands by when a peer replica group holds the lease: only a plain trainer's lease refuses it."""
    current = current_lease(model_dir, storage_options=storage_options)
    peer = group is not None and current is not None and current.group is not None  # a standby starts
    if current is not None and current.held(time.time()) and not current.replaceable(group) and not peer:
        raise _held_error(model_dir, current)


def take_over(model_dir: str, *, storage_options: dict[str, Any] | None = None) -> WriterLeaseRecord | None:
    """Fence off the current holder of ``model_dir``'s writer lease: write the next token as a
    released lease, so the holder's next :meth:`WriterLease.check` fails and the next
    :meth:`WriterLease.acquire` succeeds. Returns the lease taken over (None when there was none
    held). Two concurrent take-overs are fine: each writes a token of its own, or loses the race."""
    directory = _Dir(model_dir, storage_options)
    current = directory.current()
    if current is None or not current.held(time.time()):
        return None
    directory.create(_record(current.token + 1, 0.0, released=True))
    logger.warning("took over the writer lease of %s from %s", model_dir, current.describe(time.time()))
    return current


class WriterLease:
    """This process's hold on a model dir's writer lease (see the module doc): renewed from a
    daemon thread until :meth:`release`; :meth:`check` is the fence. Get one with :meth:`acquire`."""

    def __init__(self, directory: _Dir, record: WriterLeaseRecord, ttl: float, *, previous: int | None = None) -> None:
        self._dir = directory
        self._previous = previous  # the token before this one: the files below it go at the release
        self._record = record
        self.ttl = ttl
        # When the last successful write's ``expires`` was computed, by this process's monotonic clock
        # (not when the write returned: on an object store that can be much later).
        self._renewed_at = time.monotonic() - max(0.0, time.time() - record.renewed)
        self._lost: str | None = None  # why it is lost, once known
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_loop, name=f"cadence-writer-lease-{record.token}",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, model_dir: str, *, ttl: float = DEFAULT_WRITER_LEASE_TTL,
                storage_options: dict[str, Any] | None = None, group: str | None = None) -> WriterLease:
        """Take the writer lease of ``model_dir`` (created if missing) or raise. ``group``: this
        process is that replica group's chief (recorded in the lease; see the module doc).

        Raises:
          WriterLeaseHeldError: another live process holds it; the message names the holder and
            how to take over. Nothing was written.
          ValueError: ``ttl`` is not a finite number of seconds > 0.
        """
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
            raise ValueError(f"the writer lease ttl must be a finite number of seconds > 0, got {ttl!r}")
        directory = _Dir(model_dir, storage_options)
        current = directory.current()
        if current is not None and current.held(time.time()) and not current.replaceable(group):
            raise _held_error(model_dir, current)
        record = _record((current.token if current is not None else 0) + 1, float(ttl), group=group)
        if not directory.create(record):  # another process acquired it first
            winner = directory.read(record.token)
            raise _held_error(model_dir, winner)
        if current is not None and current.held(time.time()):
            logger.warning("%s: took over the writer lease from a holder that is gone (or this process): %s", model_dir,
                           current.describe(time.time()))
        logger.debug("acquired writer lease %d of %s", record.token, model_dir)
        return cls(directory, record, float(ttl), previous=current.token if current is not None else None)

    def __repr__(self) -> str:
        return f"WriterLease({self._dir.model_dir!r}, token={self.token})"

    @property
    def token(self) -> int:
        """The fencing token of this acquisition."""
        return self._record.token

    @property
    def model_dir(self) -> str:
        return self._dir.model_dir

    @property
    def record(self) -> WriterLeaseRecord:
        """This acquisition as last written (its token, holder and times)."""
        return self._record

    def check(self, action: str) -> None:
        """The fence: return when this process still holds the lease, else raise
        :class:`~cadence.errors.WriterLeaseLostError` naming ``action`` (what was not done) and why.
        Costs one listing of ``.writer/``."""
        reason = self._lost
        if reason is None and time.monotonic() - self._renewed_at >= self.ttl:
            reason = f"could not renew it for {self.ttl:g}s (the ttl); another trainer may have taken over"
        if reason is None:
            newer = [t for t in self._dir.tokens() if t > self.token]
            if newer:
                reason = self._taken_over_reason(newer[-1])
        if reason is not None:
            self._lost = reason
            raise WriterLeaseLostError(f"{self._dir.model_dir}: not allowed to {action}: lost the writer lease "
                                       f"{self.token}: {reason}")

    @property
    def lost(self) -> bool:
        """True once this process knows it no longer holds the lease."""
        return self._lost is not None

    def release(self) -> None:
        """Stop renewing and mark the lease released (when still held), then remove the files of
        the tokens before the previous one; idempotent. A failure to write is logged (at DEBUG when
        the disk is full: the run's own error says so in its one line): the lease then expires on
        its own."""
        self._end(withdraw=False)

    def withdraw(self) -> None:
        """Stop renewing and remove this acquisition's file, as if it had never been taken (a run
        refused before it changed the model dir; see the module doc for why that is safe); the
        older files stay. Released instead when a newer lease exists (taken over: the file is
        history) or the file cannot be removed. Idempotent; a no-op after :meth:`release`."""
        self._end(withdraw=True)

    def _end(self, *, withdraw: bool) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._lost is not None:
                return
            self._lost = "withdrawn" if withdraw else "released"
            if any(t > self.token for t in self._safe_tokens()):
                return  # taken over: its file is history now
            if withdraw:
                try:
                    self._dir.storage.remove(self._dir.path(self.token))
                    return
                except Exception as e:  # noqa: BLE001 - released below instead
                    logger.debug("could not withdraw the writer lease of %s; releasing it: %s", self._dir.model_dir, e)
            try:
                self._dir.storage.write_atomic(self._dir.path(self.token),
                                               replace(self._record, released=True, expires=time.time()).to_json())
            except Exception as e:  # noqa: BLE001 - it expires anyway
                logger.log(logging.DEBUG if space_cause(e) is not None else logging.WARNING,
                           "could not release the writer lease of %s (it expires within %gs): %s",
                           self._dir.model_dir, self.ttl, e)
                return
            if not withdraw and self._previous is not None:
                self._dir.prune(below=self._previous)

    def __enter__(self) -> WriterLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # -- internals -----------------------------------------------------------------------------

    def _safe_tokens(self) -> list[int]:
        try:
            return self._dir.tokens()
        except Exception:  # noqa: BLE001
            return []

    def _taken_over_reason(self, token: int) -> str:
        record = self._dir.read(token)
        who = f"pid {record.pid} on host {record.host or '?'}"
        if record.released and record.since == record.expires:
            return f"{who} took it over at {_utc(record.since)}"
        return f"{who} holds it since {_utc(record.since)} (writer lease {token})"

    def _renew_loop(self) -> None:
        period = self.ttl / 4
        while not self._stop.wait(period):
            with self._lock:
                if self._lost is not None:
                    return
                try:
                    newer = [t for t in self._dir.tokens() if t > self.token]
                    if newer:
                        self._lost = self._taken_over_reason(newer[-1])
                        logger.error("%s: lost the writer lease: %s; the next commit will fail",
                                     self._dir.model_dir, self._lost)
                        return
                    started, now = time.monotonic(), time.time()
                    self._record = replace(self._record, renewed=now, expires=now + self.ttl)
                    self._dir.storage.write_atomic(self._dir.path(self.token), self._record.to_json())
                    self._renewed_at = started  # the ttl counts from when expires was computed
                except Exception as e:  # noqa: BLE001 - retried next period; check() fences by ttl
                    logger.warning("could not renew the writer lease of %s (retrying in %gs): %s",
                                   self._dir.model_dir, period, e)


def _held_error(model_dir: str, holder: WriterLeaseRecord) -> WriterLeaseHeldError:
    return WriterLeaseHeldError(
        f"model dir {model_dir} is being written by {holder.describe(time.time())}: stop that run, wait for its "
        "lease to expire, or pass --take-over to fence it off"
    )
