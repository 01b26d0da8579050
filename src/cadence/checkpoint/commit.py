"""Writing one checkpoint and committing it: the steps of the commit protocol.

On local disks the files go into ``ckpt-N.tmp-<hex>/``, the manifest into a temp file beside them;
once all of them are fsynced (together, on helper threads), the directory is renamed to
``ckpt-N/`` and the manifest's temp file to ``MANIFEST.json`` (the commit), and both ``ckpt-N/``
and its parent are fsynced (see :meth:`Committer.commit`). On stores without atomic rename the
files go straight into ``ckpt-N/`` and the manifest, still last, is a conditional create
(:meth:`~cadence.storage.Storage.create_exclusive`; S3 ``If-None-Match: *``): a step is committed
at most once, and a writer finding a manifest already there (another writer committed the step
meanwhile) raises :class:`CheckpointError` without replacing it. Until the manifest exists the
checkpoint is invisible to readers.

There, before writing, the writer creates ``ckpt-N/.claim`` (:data:`CLAIM_NAME`) exclusively: a
second writer finding another's claim raises :class:`CheckpointError` having written nothing, so
the first writer's files are never overwritten. A claim of the same writer (an earlier failed
attempt) or of a writer holding an older writer-lease token (fenced off) is replaced, with what
that attempt left; the writer's start-up clean-up removes uncommitted ``ckpt-N/`` dirs, claims
included.

The order of the steps, the fence check right before the commit and the bookkeeping are
:meth:`cadence.checkpoint.CheckpointManager.save`'s; this module holds the steps.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint.files import SYNCERS, DirectoryWriter
from cadence.checkpoint.listing import has_manifest, step_dir
from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.checkpoint.objects import save_object
from cadence.errors import CheckpointError
from cadence.storage import Storage

if TYPE_CHECKING:
    from cadence.checkpoint.writer_lease import WriterLease

logger = logging.getLogger("cadence.checkpoint")

CLAIM_NAME = ".claim"
"""Stores without atomic rename: ``ckpt-<step>/.claim``, created exclusively by the writer about to
write the step's files there (who, where, its writer-lease token). Not in the manifest; a second
writer finding another's claim writes nothing."""


def _cadence_version() -> str:
    try:
        import cadence

        return str(getattr(cadence, "__version__", "0"))
    except ImportError:  # pragma: no cover - we are inside cadence
        return "0"


class Committer:
    """The steps of writing and committing checkpoints into ``storage`` for one writer.

    ``fence`` (the methods that claim): the writer lease this writer holds, its token recorded in
    its claims (a claim with an older token is stale); None: no fencing.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.writer_id = secrets.token_hex(8)  # names this writer's claims (CLAIM_NAME)

    def _path(self, step: int) -> str:
        return self.storage.url(step_dir(self.storage, step))

    def new_work_dir(self, step: int, fence: WriterLease | None = None) -> str:
        """The directory to write checkpoint ``step`` into: a new, empty temp dir (local disks,
        after removing an uncommitted ``ckpt-N/`` an earlier attempt left), or ``ckpt-N/`` itself,
        claimed for this writer (:meth:`claim`; a file an earlier attempt left there and this one
        does not write is not in the manifest, so never read); :class:`CheckpointError` when
        another writer committed it meanwhile or is writing it."""
        final = step_dir(self.storage, step)
        if self.storage.atomic_rename:
            work = self.storage.join(f"ckpt-{step}.tmp-{secrets.token_hex(6)}")
            self.storage.rmtree(final)  # an uncommitted leftover of an earlier attempt
            self.storage.makedirs(work)
            return work
        if has_manifest(self.storage, f"ckpt-{step}"):
            raise CheckpointError(f"checkpoint {self._path(step)} was committed by another writer meanwhile; "
                                  "not writing it again (two writers on one model dir?)")
        self.claim(step, fence)
        return final

    def claim(self, step: int, fence: WriterLease | None = None) -> None:
        """Create ``ckpt-<step>/.claim`` exclusively; replace a stale one (this writer's, or of a
        writer with an older writer-lease token: fenced off) with its attempt's leftovers; raise
        :class:`CheckpointError` when another writer's is there."""
        final = step_dir(self.storage, step)
        path = self.storage.join(f"ckpt-{step}", CLAIM_NAME)
        record = {"writer": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "token": fence.token if fence is not None else None}
        data = (json.dumps(record) + "\n").encode()
        self.storage.makedirs(final)
        for _ in range(2):
            if self.storage.create_exclusive(path, data):
                return
            try:
                holder = json.loads(self.storage.read_bytes(path))
            except FileNotFoundError:
                continue  # its writer gave up meanwhile
            except (OSError, ValueError):
                holder = None
            if not isinstance(holder, dict) or not self._stale_claim(holder, fence):
                who = (f"pid {holder.get('pid')} on host {holder.get('host')}" if isinstance(holder, dict)
                       else "an unknown writer")
                raise CheckpointError(f"checkpoint {self._path(step)} is being written by {who} (its claim "
                                      f"{self.storage.url(path)}); not writing it twice (two writers on one model dir?)")
            self.storage.rmtree(final)  # this writer's failed attempt, or a fenced-off writer's
        raise CheckpointError(f"could not claim checkpoint {self._path(step)}: another writer keeps claiming it")

    def _stale_claim(self, holder: dict[str, Any], fence: WriterLease | None) -> bool:
        if holder.get("writer") == self.writer_id:
            return True
        token = holder.get("token")
        return (fence is not None and isinstance(token, int) and not isinstance(token, bool)
                and token < fence.token)

    def write_files(self, directory: str, step: int, objects: Mapping[str, object],
                    checksum: str = checksum_lib.DEFAULT_ALGORITHM) -> DirectoryWriter:
        """Write each object's files and ``state.json`` into ``directory``, checksummed with
        ``checksum``; return the writer, closed: its ``written()`` and ``ranks()`` are the
        manifest's ``(files, ranks)`` (see :class:`~cadence.checkpoint.files.DirectoryWriter`); the
        files' fsyncs may still be running (:meth:`commit` waits for them)."""
        writer = DirectoryWriter(self.storage, directory, step, checksum)
        state: dict[str, Any] = {}
        for name, obj in objects.items():
            state[name] = save_object(name, obj, writer)
        document = {"step": step, "time": time.time(), "cadence_version": _cadence_version(), "state": state}
        writer.write_state(encode_state(document))
        writer.written()  # closed: raises for a file opened and never completed
        return writer

    def commit(self, step: int, work: str, writer: DirectoryWriter, data: bytes, check: Callable[[], None]) -> None:
        """Commit checkpoint ``step``, whose files ``writer`` wrote into ``work``, with the manifest
        ``data``; ``check()`` (the fence) runs right before the commit, once every file is durable.

        Local disks: the manifest goes into a temp file in ``work``, fsynced beside the files
        (the fsyncs run together: one journal commit rather than one per file); then ``check()``,
        ``work`` is renamed to ``ckpt-N/`` and the temp file to ``MANIFEST.json`` (the commit:
        every file it lists is durable by then), and ``ckpt-N/`` and its parent are fsynced
        (together) before this returns. A crash before the manifest's rename leaves a temp dir or
        a ``ckpt-N/`` without a manifest: invisible, removed by the writer's next start. The
        rename of ``work`` fails when another writer's ``ckpt-N/`` is there.
        Other stores: ``check()``, then the manifest by a conditional create, so a manifest is
        never replaced."""
        final = step_dir(self.storage, step)
        manifest = self.storage.join(f"ckpt-{step}", MANIFEST_NAME)
        if not self.storage.atomic_rename:
            writer.wait_durable()
            check()
            if not self.storage.create_exclusive(manifest, data):
                raise CheckpointError(f"checkpoint {self._path(step)} was committed by another writer while this "
                                      "one wrote it; its manifest is left as it is (two writers on one model dir?)")
            return
        temp = f"{MANIFEST_NAME}.tmp-{secrets.token_hex(6)}"
        self.storage.write_bytes(posixpath.join(work, temp), data, fsync=False)
        writer.sync(posixpath.join(work, temp))
        writer.wait_durable()
        check()
        if work != final:
            self.storage.rename(work, final, sync=False)
        self.storage.rename(posixpath.join(final, temp), manifest, sync=False)
        entries = SYNCERS.submit(self.storage.fsync_dir, final)
        parent = posixpath.dirname(final)
        self.storage.fsync_dir(parent)
        entries.result()

    def discard_failed(self, work: str, final: str) -> None:
        """Remove what a failed save wrote: its work dir, and ``final`` unless it is committed (a
        manifest there is another writer's commit; when that cannot be told, it is left to the
        next start's clean-up)."""
        if work != final:
            self._discard(work)
        try:
            committed = self.storage.exists(posixpath.join(final, MANIFEST_NAME))
        except Exception:  # noqa: BLE001 - unknown: keep it
            committed = True
        if not committed:
            self._discard(final)

    def _discard(self, *directories: str) -> None:
        for directory in dict.fromkeys(directories):
            try:
                self.storage.rmtree(directory)
            except Exception:  # noqa: BLE001 - the save's own error matters more
                logger.warning("could not remove %s after a failed save", self.storage.url(directory), exc_info=True)


def encode_state(document: dict[str, Any]) -> bytes:
    """``state.json``: one line per top-level key and per object's state, each encoded by json's C
    encoder (an indented document goes through its pure-Python one: 10x slower on the RNG states'
    long lists, most of a small checkpoint's save time). ``TypeError`` naming the object whose
    state is not JSON-serialisable."""
    try:
        return _json_lines(document, nested=("state",))
    except (TypeError, ValueError):
        for name, value in document["state"].items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"the checkpoint state of {name!r} is not JSON-serialisable: {e}") from e
        raise


def _json_lines(document: Mapping[str, Any], nested: tuple[str, ...] = ()) -> bytes:
    """``document`` as JSON with one ``key: value`` line per key (the keys in ``nested``: one line
    per key of their value), every value encoded compactly by json's C encoder."""
    lines = []
    for key, value in document.items():
        if key in nested and isinstance(value, Mapping) and value:
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()
