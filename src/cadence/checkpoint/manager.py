"""``CheckpointManager``: atomic commits, retention, verified restore with fall-back, ``FINAL``.

Layout of the managed directory (the model dir's ``checkpoints/``)::

    ckpt-<step>/            one committed checkpoint: its files, state.json, MANIFEST.json (last)
    ckpt-<step>.tmp-<hex>/  a checkpoint being written (local disks); invisible, cleaned at start-up
    ckpt-<step>/.claim      (other stores) who writes ckpt-<step>/: created exclusively before its files
    FINAL                   {"step": N, "time": ..., "reason": ...}: training completed at step N
                            (reason: why it stopped early, when an action stopped it)
    .leases/                readers' leases (not a checkpoint; see :mod:`cadence.checkpoint.leases`)
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint import manifest as manifest_lib
from cadence.checkpoint import retention
from cadence.checkpoint.background import yield_cpu
from cadence.checkpoint.leases import Leases
from cadence.checkpoint.files import STATE_NAME, DirectoryWriter, VerifiedReader
from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.checkpoint.objects import load_object, save_object, snapshot_objects
from cadence.checkpoint.protocol import Restorable, Savable
from cadence.extensions import Stateful
from cadence.checkpoint.space import raise_if_full
from cadence.runtime.coordination import Coordinator
from cadence.storage import Storage
from cadence.errors import CheckpointError, CheckpointSpaceError, CorruptCheckpointError

if TYPE_CHECKING:
    from cadence.checkpoint.writer_lease import WriterLease

logger = logging.getLogger("cadence.checkpoint")

FINAL_NAME = "FINAL"
_COMMITTED = re.compile(r"ckpt-(0|[1-9][0-9]*)")
_TEMP = re.compile(r"ckpt-(0|[1-9][0-9]*)\.tmp-[0-9a-f]+")
CORRUPT_INFIX = ".corrupt-"
"""Between ``ckpt-<step>`` and the time in the name of a checkpoint moved aside as corrupt."""
_CORRUPT = re.compile(r"ckpt-(0|[1-9][0-9]*)" + re.escape(CORRUPT_INFIX) + r"[0-9TZ]+-[0-9a-f]+")
_FINAL_TEMP = re.compile(re.escape(FINAL_NAME) + r"\.tmp-[0-9a-f]+")
CLAIM_NAME = ".claim"
"""Stores without atomic rename: ``ckpt-<step>/.claim``, created exclusively by the writer about to
write the step's files there (who, where, its writer-lease token). Not in the manifest; a second
writer finding another's claim writes nothing (see :meth:`CheckpointManager._save_now`)."""
STALE_LEASE_GRACE = 3600.0
"""Seconds a lease must have been expired before the writer's start-up clean-up removes its file."""


def _cadence_version() -> str:
    try:
        import cadence

        return str(getattr(cadence, "__version__", "0"))
    except ImportError:  # pragma: no cover - we are inside cadence
        return "0"


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step is an int >= 0, got {step!r}")
    return step


class CheckpointManager:
    """Saves, lists, restores and prunes the checkpoints in ``directory``.

    Args:
      directory: the model dir's ``checkpoints/``, a local path or an fsspec URL.
      max_to_keep: how many of the newest checkpoints retention keeps; None keeps all, 0 keeps none
        but the one just saved (the checkpoint just committed is never deleted).
      keep_every_n_steps: also keep, for each multiple of n, the first checkpoint at or after it
        (see :func:`cadence.checkpoint.retention.kept_every_n`). None: no such checkpoints.
      storage_options: passed to fsspec.
      protected_steps: called at each retention pass; the steps it returns are not deleted either
        (on top of the readers' leases, which are always honoured; see below).
      writer: True for the one process that saves (the chief): it creates ``directory`` and cleans
        up after crashed saves -- temp dirs ``ckpt-N.tmp-*`` and ``ckpt-N/`` dirs without a
        manifest -- and removes lease files expired for more than :data:`STALE_LEASE_GRACE`
        seconds (dead readers'; unexpired ones are never touched). False for readers (sidecar
        evaluators, tools): nothing on disk is changed, and :meth:`save`, :meth:`mark_final` and
        :meth:`clear_final` raise :class:`CheckpointError`.
        There must be at most one writer per directory at a time: see ``fence``.
      fence: the model dir's writer lease this writer holds
        (:class:`~cadence.checkpoint.writer_lease.WriterLease`): checked right before each commit
        (the manifest write), each deletion (retention, :meth:`delete`, clean-up), moving aside,
        and FINAL; a lost lease raises :class:`~cadence.errors.WriterLeaseLostError` and nothing
        more is changed. Not released by this manager. None: no fencing (one writer is assumed).
      async_save: :meth:`save` returns once the objects are snapshotted into memory (an object's
        ``snapshot_checkpoint()`` when it has one, see :mod:`cadence.checkpoint.protocol`); a
        background thread writes and commits (same protocol). At most one save is in flight: the
        next :meth:`save` waits for it. A failed background save is raised (as
        :class:`CheckpointError`) by the next :meth:`save`, :meth:`wait` or
        :meth:`raise_if_failed`. :meth:`close` (and interpreter exit: the thread is not a daemon)
        waits for the pending commit.
      checksum: the algorithm of the checksums new manifests record
        (:data:`~cadence.checkpoint.checksum.ALGORITHMS`; CRC32C by default). Reading verifies
        each file with the algorithm its manifest names, whatever this is.

    Each object saved or restored under a name is either *Checkpointable* (``save_checkpoint`` /
    ``load_checkpoint``) or *Stateful* (``state_dict`` / ``load_state_dict``), see
    :mod:`cadence.checkpoint.protocol`; the Checkpointable methods win when both exist.

    Retention honours readers' leases: a checkpoint protected by an unexpired lease in
    ``directory/.leases/`` (its ``reading`` step, or any step after its ``after``; see
    :mod:`cadence.checkpoint.leases`, :attr:`leases`) is kept until the lease ends or is released.
    Each retention pass reads them once (one listing of ``.leases/`` and one small read per lease);
    when they, or ``protected_steps``, cannot be read, nothing is deleted that time (a warning is
    logged). ``.leases/`` is not a checkpoint: listing, restoring and clean-up ignore it.
    :meth:`delete` is an explicit request and ignores leases.
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int | None = retention.DEFAULT_MAX_TO_KEEP,
        keep_every_n_steps: int | None = None,
        storage_options: dict[str, Any] | None = None,
        protected_steps: Callable[[], Iterable[int]] | None = None,
        writer: bool = True,
        async_save: bool = False,
        fence: WriterLease | None = None,
        checksum: str = checksum_lib.DEFAULT_ALGORITHM,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 0):
            raise ValueError(f"max_to_keep must be None or an int >= 0, got {max_to_keep!r}")
        if keep_every_n_steps is not None and (not isinstance(keep_every_n_steps, int) or keep_every_n_steps < 1):
            raise ValueError(f"keep_every_n_steps must be None or an int >= 1, got {keep_every_n_steps!r}")
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.protected_steps = protected_steps
        self.writer = writer
        self.async_save = async_save
        self.fence = fence
        checksum_lib.new(checksum)  # ValueError naming the known algorithms
        self.checksum = checksum
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._just_committed: list[tuple[int, str]] = []  # appended by the saving thread, taken by take_committed()
        self._committed_here: set[int] = set()  # steps this manager committed: known good
        self._begun: dict[int, str] = {}  # step -> its work dir, from begin() until save()
        self._writer_id = secrets.token_hex(8)  # names this manager's claims (CLAIM_NAME)
        self.storage = Storage(directory, storage_options)
        self.leases = Leases(directory, storage_options=storage_options)
        if writer:
            self.storage.makedirs(self.storage.root)
            self._clean_up()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, writer={self.writer})"

    # -- listing -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending: ``ckpt-<step>`` dirs with a manifest.

        Cheap (no hashing): a listed checkpoint may still turn out corrupt when read. Empty when
        ``directory`` does not exist yet.
        """
        found = []
        for name in self.storage.listdir(self.storage.root):
            match = _COMMITTED.fullmatch(name)
            if match and self._has_manifest(name):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        """Where checkpoint ``step`` lives (or would live): a local path or an fsspec URL."""
        return self.storage.url(self._dir(step))

    def manifest(self, step: int) -> dict[str, Any]:
        """The validated manifest of committed checkpoint ``step``.

        Raises :class:`CheckpointError` when ``step`` is not committed and
        :class:`CorruptCheckpointError` when its manifest is invalid.
        """
        self._require_committed(step)
        return manifest_lib.read(self.storage, self._dir(step), step)

    def read_state(self, step: int) -> dict[str, Any]:
        """The ``state.json`` of committed checkpoint ``step`` (checked against the manifest).

        Raises as :meth:`manifest`, and :class:`CorruptCheckpointError` when ``state.json`` does
        not match the manifest or is not a valid state document.
        """
        manifest = self.manifest(step)
        data = manifest_lib.read_verified(self.storage, self._dir(step), manifest, STATE_NAME)
        return self._parse_state(data, step)

    def info(self, step: int) -> dict[str, Any]:
        """``{"step", "time", "size", "files", "path"}`` of checkpoint ``step`` from its manifest alone
        (``size``: total bytes; ``files``: how many). Raises as :meth:`manifest`."""
        manifest = self.manifest(step)
        files = manifest["files"]
        return {
            "step": step,
            "time": manifest["time"],
            "size": sum(entry["size"] for entry in files.values()),
            "files": len(files),
            "path": self.path(step),
        }

    # -- saving --------------------------------------------------------------------------------

    def save(self, step: int, objects: Mapping[str, object]) -> str:
        """Commit checkpoint ``step`` holding ``objects`` and apply retention; return its path.

        With ``async_save``, returns once ``objects`` are snapshotted; see the class doc.
        """
        if not self.async_save:
            return self._save_now(step, objects)
        self.wait()  # one save in flight at most; raises a previous failure
        step = _check_step(step)
        self._require_writer("save")
        if self._already_saved(step):
            return self.path(step)
        snapshot = snapshot_objects(step, objects)

        def commit() -> None:
            yield_cpu()  # training goes first when the two compete for a core
            try:
                self._save_now(step, snapshot)
            except BaseException as e:  # noqa: BLE001 - surfaced by the next save/wait
                self._pending_error = e

        self._pending = threading.Thread(target=commit, name=f"cadence-save-{step}", daemon=False)
        self._pending.start()
        return self.path(step)

    def begin(self, step: int) -> str | None:
        """Start checkpoint ``step`` for a sharded save: create the directory every rank writes
        its files into (``ckpt-N.tmp-<hex>/`` on local disks, ``ckpt-N/`` on object stores) and
        return its location (a path or URL); the next :meth:`save` of ``step`` commits it. None
        when ``step`` is already committed (nothing to write). Writers only."""
        step = _check_step(step)
        self._require_writer("save")
        if self._already_saved(step):
            return None
        self.abandon(step)  # an earlier begin() never saved
        try:
            self._begun[step] = self._new_work_dir(step)
        except BaseException as e:
            raise_if_full(e, self.storage, f"save checkpoint step {step}")
            raise
        return self.storage.url(self._begun[step])

    def abandon(self, step: int) -> None:
        """Remove the directory :meth:`begin` created for ``step`` (the ranks' write failed);
        nothing happens when there is none."""
        work = self._begun.pop(step, None)
        if work is not None:
            self._discard_failed(work, self._dir(step))

    def wait(self) -> None:
        """Block until an asynchronous save in flight is committed; raise its failure if it failed."""
        pending = self._pending
        if pending is not None:
            pending.join()
            self._pending = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckpointError` if a finished asynchronous save failed (does not block)."""
        error, self._pending_error = self._pending_error, None
        if error is not None:
            kind = CheckpointSpaceError if isinstance(error, CheckpointSpaceError) else CheckpointError
            raise kind(f"asynchronous checkpoint save failed: {error}") from error

    def close(self) -> None:
        """Wait for a pending asynchronous save (raising its failure)."""
        self.wait()

    def take_committed(self) -> list[tuple[int, str]]:
        """``(step, path)`` of each checkpoint committed by this manager since the last call, in
        commit order. Asynchronous commits appear once their background thread has committed them
        (after :meth:`wait` at the latest). Used to tell callbacks about commits on the caller's
        thread."""
        taken: list[tuple[int, str]] = []
        while self._just_committed:
            taken.append(self._just_committed.pop(0))
        return taken

    def _save_now(self, step: int, objects: Mapping[str, object]) -> str:
        """Commit checkpoint ``step`` holding ``objects`` and apply retention; return its path.

        Each object with ``save_checkpoint(writer)`` writes its files through the writer and its
        return value (JSON) is stored under its name in ``state.json``; an object with only
        ``state_dict()`` has that stored instead; any other object raises ``TypeError`` before
        anything is written. Bad, duplicate or reserved file names (``state.json``,
        ``MANIFEST.json``) raise ``ValueError``; a state that is not JSON raises ``TypeError``.

        The commit follows the design's protocol: on local disks files go into
        ``ckpt-N.tmp-<hex>/`` and are fsynced, the directory is renamed to ``ckpt-N/`` (parent
        fsynced) and ``MANIFEST.json`` is written last (temp file + rename). On stores without
        atomic rename files go straight into ``ckpt-N/`` and the manifest, still last, is a
        conditional create (:meth:`~cadence.storage.Storage.create_exclusive`; S3
        ``If-None-Match: *``): a step is committed at most once, and a writer that finds a
        manifest already there (another writer committed the step meanwhile) raises
        :class:`CheckpointError` without replacing it. Until the manifest exists the checkpoint
        is invisible to :meth:`steps` and :meth:`restore`.

        There, before writing, the writer creates ``ckpt-N/.claim`` (:data:`CLAIM_NAME`)
        exclusively: a second writer finding another's claim raises :class:`CheckpointError` having
        written nothing, so the first writer's files are never overwritten. A claim of this manager
        (an earlier failed attempt) or of a writer holding an older writer-lease token than
        ``fence`` (fenced off) is replaced, with what that attempt left; the writer's start-up
        clean-up removes uncommitted ``ckpt-N/`` dirs, claims included.

        A step started with :meth:`begin` is committed from the directory it created, where the
        ranks of a sharded save wrote their files (added to the manifest by the objects, see
        :meth:`~cadence.checkpoint.protocol.CheckpointWriter.add_files`).

        If ``ckpt-N`` is already committed and verifies, nothing is written and its path is
        returned; one that does not verify is moved aside (:meth:`quarantine`) and saved anew. If
        saving raises, what was written is removed and the exception propagates: no checkpoint
        appears. A committed checkpoint (one with a manifest: another writer's) is never removed
        on that path.
        """
        step = _check_step(step)
        self._require_writer("save")
        final = self._dir(step)
        begun = self._begun.pop(step, None)
        if self._already_saved(step):
            logger.debug("checkpoint %s is already committed; not saving again", self.path(step))
            if begun is not None:
                self._discard_failed(begun, final)
            return self.path(step)
        for name, obj in objects.items():
            if not isinstance(obj, (Savable, Stateful)):
                if begun is not None:
                    self._discard_failed(begun, final)  # as after any failed save: nothing left behind
                raise TypeError(f"cannot checkpoint {name!r}: {type(obj).__name__} has neither save_checkpoint nor state_dict")
        work = begun if begun is not None else final
        owned = begun is not None  # work is this save's to remove on failure (not another writer's)
        try:
            if begun is None:
                work = self._new_work_dir(step)
                owned = True
            files, ranks = self._write_files(work, step, objects)
            if work != final:
                self.storage.rename(work, final)
            document = manifest_lib.build(step, files, algorithm=self.checksum, ranks=ranks)
            self._require_writer(f"commit checkpoint {self.path(step)}")  # the fence, right before the commit
            self._commit_manifest(step, manifest_lib.encode(document))
        except BaseException as e:
            if owned:
                self._discard_failed(work, final)
            raise_if_full(e, self.storage, f"save checkpoint step {step}")
            raise
        logger.info("saved checkpoint %s", self.path(step))
        self._just_committed.append((step, self.path(step)))
        self._committed_here.add(step)
        self._apply_retention(step)
        return self.path(step)

    def _commit_manifest(self, step: int, data: bytes) -> None:
        """Write ``ckpt-<step>/MANIFEST.json``, the commit. Local disks: temp file + rename (the
        directory was just renamed into place, which fails when another writer's is there).
        Other stores: a conditional create, so a manifest is never replaced."""
        path = self.storage.join(f"ckpt-{step}", MANIFEST_NAME)
        if self.storage.atomic_rename:
            self.storage.write_atomic(path, data)
        elif not self.storage.create_exclusive(path, data):
            raise CheckpointError(f"checkpoint {self.path(step)} was committed by another writer while this one "
                                  "wrote it; its manifest is left as it is (two writers on one model dir?)")

    def _new_work_dir(self, step: int) -> str:
        """The directory to write checkpoint ``step`` into: a new, empty temp dir (local disks,
        after removing an uncommitted ``ckpt-N/`` an earlier attempt left), or ``ckpt-N/`` itself,
        claimed for this writer (:meth:`_claim`; a file an earlier attempt left there and this one
        does not write is not in the manifest, so never read); :class:`CheckpointError` when
        another writer committed it meanwhile or is writing it."""
        final = self._dir(step)
        if self.storage.atomic_rename:
            work = self.storage.join(f"ckpt-{step}.tmp-{secrets.token_hex(6)}")
            self.storage.rmtree(final)  # an uncommitted leftover of an earlier attempt
            self.storage.makedirs(work)
            return work
        if self._has_manifest(f"ckpt-{step}"):
            raise CheckpointError(f"checkpoint {self.path(step)} was committed by another writer meanwhile; "
                                  "not writing it again (two writers on one model dir?)")
        self._claim(step)
        return final

    def _claim(self, step: int) -> None:
        """Create ``ckpt-<step>/.claim`` exclusively; replace a stale one (this manager's, or of a
        writer with an older writer-lease token: fenced off) with its attempt's leftovers; raise
        :class:`CheckpointError` when another writer's is there."""
        final = self._dir(step)
        path = self.storage.join(f"ckpt-{step}", CLAIM_NAME)
        record = {"writer": self._writer_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "token": self.fence.token if self.fence is not None else None}
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
            if not isinstance(holder, dict) or not self._stale_claim(holder):
                who = (f"pid {holder.get('pid')} on host {holder.get('host')}" if isinstance(holder, dict)
                       else "an unknown writer")
                raise CheckpointError(f"checkpoint {self.path(step)} is being written by {who} (its claim "
                                      f"{self.storage.url(path)}); not writing it twice (two writers on one model dir?)")
            self.storage.rmtree(final)  # this manager's failed attempt, or a fenced-off writer's
        raise CheckpointError(f"could not claim checkpoint {self.path(step)}: another writer keeps claiming it")

    def _stale_claim(self, holder: dict[str, Any]) -> bool:
        if holder.get("writer") == self._writer_id:
            return True
        token = holder.get("token")
        return (self.fence is not None and isinstance(token, int) and not isinstance(token, bool)
                and token < self.fence.token)

    def _discard_failed(self, work: str, final: str) -> None:
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

    def _write_files(self, directory: str, step: int,
                     objects: Mapping[str, object]) -> tuple[dict[str, tuple[int, str]], dict[str, int]]:
        writer = DirectoryWriter(self.storage, directory, step, self.checksum)
        state: dict[str, Any] = {}
        for name, obj in objects.items():
            state[name] = save_object(name, obj, writer)
        document = {"step": step, "time": time.time(), "cadence_version": _cadence_version(), "state": state}
        writer.write_state(self._encode_state(document))
        return writer.files(), writer.ranks()

    @staticmethod
    def _encode_state(document: dict[str, Any]) -> bytes:
        """``state.json``: one line per top-level key and per object's state, each encoded by
        json's C encoder (an indented document goes through its pure-Python one: 10x slower on the
        RNG states' long lists, most of a small checkpoint's save time)."""
        try:
            return _json_lines(document, nested=("state",))
        except (TypeError, ValueError):
            for name, value in document["state"].items():
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as e:
                    raise TypeError(f"the checkpoint state of {name!r} is not JSON-serialisable: {e}") from e
            raise

    def _discard(self, *directories: str) -> None:
        for directory in dict.fromkeys(directories):
            try:
                self.storage.rmtree(directory)
            except Exception:  # noqa: BLE001 - the save's own error matters more
                logger.warning("could not remove %s after a failed save", self.storage.url(directory), exc_info=True)

    # -- retention -----------------------------------------------------------------------------

    def _apply_retention(self, just_saved: int) -> None:
        if self.max_to_keep is None:
            return  # keeps everything: no need to read the leases
        steps = self.steps()
        try:
            protected = self.leases.protected_steps(steps)
        except Exception:  # noqa: BLE001 - unknown leases: delete nothing this time
            logger.warning("could not read the readers' leases in %s; skipping retention this time",
                           self.storage.url(self.leases.root), exc_info=True)
            return
        try:
            if self.protected_steps is not None:
                protected |= set(self.protected_steps())
        except Exception:  # noqa: BLE001 - unknown leases: delete nothing this time
            logger.warning("protected_steps failed; skipping retention this time", exc_info=True)
            return
        doomed = retention.steps_to_delete(
            steps,
            just_saved=just_saved,
            max_to_keep=self.max_to_keep,
            keep_every_n_steps=self.keep_every_n_steps,
            protected=protected,
        )
        if doomed:
            self._require_writer("delete old checkpoints (retention)")
        for step in doomed:
            try:
                self._delete(step)
            except Exception:  # noqa: BLE001 - the save itself succeeded
                logger.warning("could not delete checkpoint %s", self.path(step), exc_info=True)

    def delete(self, step: int) -> None:
        """Delete committed checkpoint ``step``: its manifest first (readers stop seeing it at
        once), then its directory. Raises :class:`CheckpointError` when it is not committed or
        this manager is a reader."""
        self.wait()
        step = _check_step(step)
        self._require_writer("delete")
        self._require_committed(step)
        self._delete(step)

    def _delete(self, step: int) -> None:
        """Manifest first (readers stop seeing the checkpoint), then the directory. A ``ckpt-<step>``
        that is a symbolic link is removed as a link: nothing it points to is deleted."""
        if self.storage.link_under(self._dir(step)) is None:
            self.storage.remove(self.storage.join(f"ckpt-{step}", MANIFEST_NAME))
        self.storage.rmtree(self._dir(step))
        logger.debug("deleted checkpoint %s (retention)", self.path(step))

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, objects: Mapping[str, object], step: int | None = None, *,
                coordinator: Coordinator | None = None) -> int | None:
        """Restore ``objects`` from checkpoint ``step`` (None: the latest good one); return its step.

        ``coordinator``: a collective restore, every rank of a job calling it: the ranks restore
        the same checkpoint (the chief's list of checkpoints is used), and the files of a sharded
        checkpoint written by the ranks are verified once in all, shared among the ranks (see
        :func:`~cadence.checkpoint.manifest.verify_all`), the ranks agreeing on the result before
        any object is restored. None: this process verifies every file.

        Returns None, touching nothing, when no committed checkpoint exists. All files are read
        and verified against the manifest before any object is called, so a corrupt checkpoint
        leaves the objects untouched. Then, in order, each object with ``load_checkpoint`` gets
        ``(reader, its state.json value or None)``; an object with only ``load_state_dict`` gets
        its ``state.json`` value, and is skipped (debug log) when it has none. Objects with
        neither raise ``TypeError`` before anything is read.

        ``step=None``: a corrupt, truncated or unreadable checkpoint is logged as a warning
        (naming its path and the reason) and skipped for the one before it; when every committed
        checkpoint is bad, :class:`CheckpointError` is raised rather than starting from scratch.
        Explicit ``step``: :class:`CheckpointError` (listing the available steps) when it is not
        committed, :class:`CorruptCheckpointError` when it is bad.

        Errors raised by the objects' own loading (e.g. ``UnsafeCheckpointError``) propagate
        unchanged, with no fall-back.
        """
        self.wait()
        for name, obj in objects.items():
            if not isinstance(obj, (Restorable, Stateful)):
                raise TypeError(f"cannot restore {name!r}: {type(obj).__name__} has neither load_checkpoint nor load_state_dict")
        if step is None:
            loaded = self._load_latest(coordinator)
            if loaded is None:
                return None
        else:
            step = _check_step(step)
            self._require_committed(step)
            loaded = self._load(step, coordinator)
        reader, state = loaded
        self._apply(objects, reader, state)
        logger.info("restored checkpoint %s", reader.path)
        return reader.step

    def read(self, step: int) -> tuple[VerifiedReader, dict[str, Any]]:
        """Read and verify every file of committed checkpoint ``step``: ``(reader, state.json)``.

        Changes nothing. Raises :class:`CheckpointError` when ``step`` is not committed and
        :class:`CorruptCheckpointError` when its files do not match the manifest.
        """
        step = _check_step(step)
        self._require_committed(step)
        return self._load(step)

    def _load_latest(self, coordinator: Coordinator | None = None) -> tuple[VerifiedReader, dict[str, Any]] | None:
        steps = self.steps()
        if coordinator is not None and coordinator.world_size > 1:
            steps = coordinator.broadcast(steps)  # every rank tries the same checkpoints
        corrupt: list[tuple[int, str]] = []  # newer than the one restored: moved aside by a writer
        for step in reversed(steps):
            try:
                loaded = self._load(step, coordinator)
            except CorruptCheckpointError as e:
                logger.warning("skipping checkpoint %s: %s", e.path, e.reason)
                corrupt.append((step, e.reason))
                continue
            if self.writer:  # saved anew when training reaches them again, not skipped for ever
                for bad, reason in corrupt:
                    self.quarantine(bad, reason)
            return loaded
        if steps:
            raise CheckpointError(
                f"every committed checkpoint in {self.storage.url(self.storage.root)} is corrupt "
                f"(steps {steps}; see the warnings); refusing to start from scratch over them"
            )
        return None

    def _load(self, step: int, coordinator: Coordinator | None = None) -> tuple[VerifiedReader, dict[str, Any]]:
        """Read and verify every file of checkpoint ``step`` (with a ``coordinator`` of several
        ranks: this rank's share of the ranks' files, then the ranks agree); raise
        CorruptCheckpointError if bad."""
        directory = self._dir(step)
        collective = coordinator is not None and coordinator.world_size > 1
        problem: CorruptCheckpointError | None = None
        try:
            manifest = manifest_lib.read(self.storage, directory, step)
            if STATE_NAME not in manifest["files"]:
                raise CorruptCheckpointError(self.path(step), f"{STATE_NAME} is not listed in {MANIFEST_NAME}")
            share = (coordinator.rank, coordinator.world_size) if collective and coordinator is not None else None
            files = manifest_lib.verify_all(self.storage, directory, manifest, share)
            state = self._parse_state(files[STATE_NAME], step)
        except CorruptCheckpointError as e:
            if not collective:
                raise
            problem = e
        if collective and coordinator is not None:
            found = [p for p in coordinator.all_gather(None if problem is None else (problem.path, problem.reason)) if p]
            if found:
                raise CorruptCheckpointError(*found[0])
        def fetch(name: str) -> memoryview:  # a file whose verification was another rank's share
            return manifest_lib.read_verified(self.storage, directory, manifest, name)

        reader = VerifiedReader(step, self.path(step), files, listed=list(manifest["files"]), fetch=fetch,
                                storage_options=self.storage.options)
        return reader, state

    @staticmethod
    def _apply(objects: Mapping[str, object], reader: VerifiedReader, state: dict[str, Any]) -> None:
        for name, obj in objects.items():
            load_object(name, obj, reader, state["state"])

    def _parse_state(self, data: memoryview, step: int) -> dict[str, Any]:
        try:
            document = json.loads(data.tobytes())
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptCheckpointError(self.path(step), f"{STATE_NAME} is not valid JSON ({e})") from None
        if not isinstance(document, dict) or not isinstance(document.get("state"), dict):
            raise CorruptCheckpointError(self.path(step), f"{STATE_NAME} has no 'state' object")
        if document.get("step") != step:
            raise CorruptCheckpointError(self.path(step), f"{STATE_NAME} is for step {document.get('step')!r}")
        return document

    # -- FINAL ---------------------------------------------------------------------------------

    def mark_final(self, step: int, reason: str | None = None) -> None:
        """Record (atomically) that training completed at committed checkpoint ``step``; a
        ``FINAL`` naming ``step`` already is left as it is (its time says when training ended).
        ``reason``: why training stopped there before its target (an action's stop: early
        stopping, a sweep's pruner), written as ``FINAL``'s ``reason``; None: none written.

        Raises :class:`CheckpointError` when ``step`` is not committed or this is a reader.
        """
        self.wait()  # FINAL names a committed checkpoint
        step = _check_step(step)
        self._require_writer("mark_final")
        self._require_committed(step)
        if self.final_step() == step:
            return
        data = json.dumps({"step": step, "time": time.time(), **({"reason": reason} if reason else {})}).encode()
        try:
            self.storage.write_atomic(self.storage.join(FINAL_NAME), data)
        except OSError as e:
            raise_if_full(e, self.storage, f"write {FINAL_NAME} for step {step}")
            raise

    def final_step(self) -> int | None:
        """The step named by ``FINAL``, or None when there is none (an unreadable one is warned about)."""
        path = self.storage.join(FINAL_NAME)
        try:
            document = json.loads(self.storage.read_bytes(path))
            step = document["step"]
            return _check_step(step)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.warning("ignoring unreadable %s: %s", self.storage.url(path), e)
            return None

    def clear_final(self) -> None:
        """Remove ``FINAL`` (training continues past it); nothing happens when there is none."""
        self._require_writer("clear_final")
        path = self.storage.join(FINAL_NAME)
        if self.storage.exists(path):
            self.storage.remove(path)

    # -- internals -----------------------------------------------------------------------------

    def _dir(self, step: int) -> str:
        return self.storage.join(f"ckpt-{step}")

    def _already_saved(self, step: int) -> bool:
        """Whether ``ckpt-<step>`` is committed and good: committed by this manager, or verified
        now (a corrupt one is moved aside, and False returned)."""
        if not self._has_manifest(f"ckpt-{step}"):
            return False
        if step in self._committed_here:
            return True
        try:
            self._load(step)
        except CorruptCheckpointError as e:
            self.quarantine(step, e.reason)
            return False
        self._committed_here.add(step)
        return True

    def quarantine(self, step: int, reason: str) -> str:
        """Move checkpoint ``step``, which does not verify, aside to ``ckpt-<step>.corrupt-<UTC
        time>-<hex>/`` -- kept for inspection, never deleted, no longer listed -- so that the step
        can be saved anew. Returns where it went (a path or URL). Writers only."""
        self._require_writer("move aside")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.storage.join(f"ckpt-{step}{CORRUPT_INFIX}{stamp}-{secrets.token_hex(2)}")
        self.storage.rename(self._dir(step), target)
        self._committed_here.discard(step)
        logger.warning("checkpoint %s does not verify (%s): moved aside to %s; the step is saved anew when reached",
                       self.path(step), reason, self.storage.url(target))
        return self.storage.url(target)

    def quarantined(self) -> list[str]:
        """The checkpoints moved aside because they did not verify (:meth:`quarantine`), by name."""
        return sorted(n for n in self.storage.listdir(self.storage.root) if _CORRUPT.fullmatch(n))

    def _has_manifest(self, dirname: str) -> bool:
        return self.storage.exists(self.storage.join(dirname, MANIFEST_NAME))

    def _require_writer(self, what: str) -> None:
        """Raise unless this manager may change the directory now: a writer, holding ``fence``."""
        if not self.writer:
            raise CheckpointError(f"{what}: this manager of {self.directory} is a reader (writer=False)")
        if self.fence is not None:
            self.fence.check(what)

    def _require_committed(self, step: int) -> None:
        if not self._has_manifest(f"ckpt-{step}"):
            raise CheckpointError(
                f"no committed checkpoint for step {step} in {self.storage.url(self.storage.root)}; "
                f"available steps: {self.steps()}"
            )

    def _clean_up(self) -> None:
        """Remove what crashed saves left: temp dirs, ``ckpt-N/`` without manifest, FINAL temps;
        and the lease files of readers dead for more than :data:`STALE_LEASE_GRACE` seconds."""
        self._require_writer("clean up after interrupted saves")
        try:
            self.leases.remove_expired(grace=STALE_LEASE_GRACE)
        except Exception:  # noqa: BLE001 - stale leases protect nothing anyway
            logger.warning("could not clean up stale leases in %s", self.storage.url(self.leases.root), exc_info=True)
        for name in self.storage.listdir(self.storage.root):
            path = self.storage.join(name)
            try:
                if _TEMP.fullmatch(name) or (_COMMITTED.fullmatch(name) and not self._has_manifest(name)):
                    self.storage.rmtree(path)
                elif _FINAL_TEMP.fullmatch(name):
                    self.storage.remove(path)
                else:
                    continue
            except Exception:  # noqa: BLE001 - a leftover must not stop training
                logger.warning("could not remove leftover %s", self.storage.url(path), exc_info=True)
                continue
            logger.info("removed leftover of an interrupted save: %s", self.storage.url(path))


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
