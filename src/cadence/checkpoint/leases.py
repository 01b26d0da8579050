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

Retention may still delete steps a reader never saw: those that leave a bounded range (a trainer
that commits more than ``max_pending`` between two of the reader's looks), and those deleted before
the reader started. So before it deletes, the writer appends the steps to ``.leases/deleted-steps``
(``{"steps": [...]}``, the newest :data:`DELETED_KEPT`; :meth:`Leases.record_deleted`), and a reader
records each one it has not dealt with as skipped (:meth:`Leases.deleted`): no checkpoint
disappears unrecorded.

``after: -1`` protects every checkpoint (a reader that has evaluated nothing yet);
``after: null`` protects no range: a reader that only wants the newest checkpoint protects just
what it reads. Expired leases protect nothing: a reader that died (even by ``kill -9``) stops
holding checkpoints back at most ``ttl`` seconds later (``ttl`` +
:data:`~cadence.checkpoint.lease_file.CLOCK_SKEW_TOLERANCE` for a reader on another host).

Clocks. ``expires`` is the reader's wall clock, judged by the writer's with a tolerance for
another host's: see :mod:`cadence.checkpoint.lease_file`.

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

:class:`Leases` reads and writes the files (their format: :mod:`cadence.checkpoint.lease_file`);
:class:`~cadence.checkpoint.lease_keeper.LeaseKeeper` keeps one holder's lease fresh from a
background thread. :class:`~cadence.checkpoint.CheckpointManager` honours the leases in its
directory automatically.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from typing import Any, Iterable

from cadence.checkpoint.lease_file import (
    LEASES_DIR,
    Lease,
    check_after,
    check_max_pending,
    check_reading,
    check_seconds,
    clock_skew,
    file_name,
    holder_of,
    process_ended,
)
from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

DEFAULT_LEASE_TTL = 60.0
"""Seconds a lease lives without renewal unless told (``sidecar.lease_ttl``'s default too)."""

DELETED_FILE = "deleted-steps"
"""``.leases/deleted-steps``: the steps retention deleted, newest last (not a lease file)."""
DELETED_KEPT = 10_000
"""How many deleted steps the note keeps (the newest)."""
_TEMP = re.compile(r".+\.tmp-[0-9a-f]+")  # Storage.write_atomic's temp files
_LEFTOVER_MIN_AGE = 60.0  # a temp or unparsable file younger than this may be a write in flight


class Leases:
    """The leases of the checkpoints in ``checkpoints_dir`` (a local path or an fsspec URL).

    Readers call :meth:`write` / :meth:`release` (or use a
    :class:`~cadence.checkpoint.lease_keeper.LeaseKeeper`); the writer calls :meth:`protected_steps`
    at each retention pass and :meth:`remove_expired` at start-up. Nothing is created until the
    first :meth:`write`.
    """

    def __init__(self, checkpoints_dir: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.checkpoints_dir = checkpoints_dir
        self.storage = Storage(checkpoints_dir, storage_options)
        self.root = self.storage.join(LEASES_DIR)

    def __repr__(self) -> str:
        return f"Leases({self.storage.url(self.root)!r})"

    def path(self, holder: str) -> str:
        """Where ``holder``'s lease file lives (a file-system path of :attr:`storage`)."""
        return self.storage.join(LEASES_DIR, file_name(holder))

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
            after=check_after(after),
            reading=check_reading(reading),
            max_pending=check_max_pending(max_pending),
            expires=now + check_seconds("ttl", ttl),
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

    def held_elsewhere(self, holder: str, now: float | None = None) -> Lease | None:
        """``holder``'s lease when another process may hold it at ``now``: unexpired (as
        :meth:`active` judges), written by another process (not this pid on this host), and that
        process not known to have ended (:func:`~cadence.checkpoint.lease_file.process_ended`: on
        this host, its pid no longer runs). None otherwise: the name is free to take. For a reader
        that must be alone under its name (one sidecar or backfill per name and model dir). A
        check, not a lock: two readers starting at the same instant both see it free."""
        for lease in self.active(now):
            if lease.holder != holder:
                continue
            ours = lease.pid == os.getpid() and lease.host == socket.gethostname()
            if not ours and not process_ended(lease.host, lease.pid):
                return lease
        return None

    def deleted(self) -> list[int]:
        """The steps the writer's retention deleted (:meth:`record_deleted`), ascending; ``[]`` when
        there are none or the note cannot be read (a warning then)."""
        path = self.storage.join(LEASES_DIR, DELETED_FILE)
        try:
            return _read_steps(self.storage.read_bytes(path))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable note %s: %s", self.storage.url(path), e)
            return []

    # -- writer side ---------------------------------------------------------------------------

    def record_deleted(self, doomed: Iterable[int]) -> None:
        """Before retention deletes ``doomed``: add them to ``.leases/deleted-steps`` (the newest
        :data:`DELETED_KEPT` are kept), so that readers record as skipped the ones they never saw.
        Storage errors propagate: the caller then deletes nothing. An unreadable note is rewritten."""
        doomed = set(doomed)
        if not doomed:
            return
        path = self.storage.join(LEASES_DIR, DELETED_FILE)
        try:
            doomed |= set(_read_steps(self.storage.read_bytes(path)))
        except (FileNotFoundError, ValueError):  # none yet, or torn by another tool: rewritten whole
            pass
        self.storage.makedirs(self.root)
        self.storage.write_atomic(path, (json.dumps({"steps": sorted(doomed)[-DELETED_KEPT:]}) + "\n").encode())

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
        written on another host is given :data:`~cadence.checkpoint.lease_file.CLOCK_SKEW_TOLERANCE` more
        (:func:`~cadence.checkpoint.lease_file.clock_skew`)."""
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
        holder = holder_of(name)
        if holder is not None:
            try:
                lease = Lease.from_json(self.storage.read_bytes(path), holder)
            except ValueError:
                return self._old(path, grace, now)
            return lease.expired(now - grace - clock_skew(lease.host))
        if _TEMP.fullmatch(name) and holder_of(name.rsplit(".tmp-", 1)[0]) is not None:
            return self._old(path, grace, now)
        return False  # not ours

    def _old(self, path: str, grace: float, now: float) -> bool:
        mtime = self.storage.mtime(path)
        return mtime is not None and now - mtime > max(grace, _LEFTOVER_MIN_AGE)

    def _lease_files(self) -> list[tuple[str, str]]:
        files = []
        for name in self.storage.listdir(self.root):
            holder = holder_of(name)
            if holder is not None:
                files.append((name, holder))
        return files


def _read_steps(data: bytes) -> list[int]:
    """The steps of the ``deleted-steps`` note; ``ValueError`` when it is not one."""
    note = json.loads(data)
    steps = note.get("steps") if isinstance(note, dict) else None
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError("not a list of steps")
    return sorted(steps)
