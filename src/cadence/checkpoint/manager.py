"""``CheckpointManager``: the face of a checkpoints directory -- atomic commits, retention,
verified restore with fall-back, ``FINAL``.

The jobs live in the modules of this package: the directory's names (:mod:`~cadence.checkpoint.listing`),
the commit protocol's steps (:mod:`~cadence.checkpoint.commit`), retention
(:mod:`~cadence.checkpoint.retention`), verified reading (:mod:`~cadence.checkpoint.restore`),
``FINAL`` (:mod:`~cadence.checkpoint.final`), clean-up and quarantine
(:mod:`~cadence.checkpoint.cleanup`), the asynchronous save (:mod:`~cadence.checkpoint.background`).
This class puts them in order and keeps the single-writer rule: every change to the directory is
made by a writer, checked against its ``fence`` first.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint import cleanup, final, listing, restore, retention
from cadence.checkpoint import manifest as manifest_lib
from cadence.checkpoint.background import BackgroundSave
from cadence.checkpoint.commit import Committer
from cadence.checkpoint.files import STATE_NAME, VerifiedReader
from cadence.checkpoint.leases import Leases
from cadence.checkpoint.listing import check_step
from cadence.checkpoint.objects import snapshot_objects
from cadence.checkpoint.protocol import Savable
from cadence.checkpoint.save_mode import AsyncSave, SaveMode, StateSize
from cadence.extensions import Stateful
from cadence.checkpoint.space import raise_if_full
from cadence.errors import CheckpointError, CheckpointSpaceError, CorruptCheckpointError
from cadence.runtime.coordination import Coordinator
from cadence.storage import Storage

if TYPE_CHECKING:
    from cadence.checkpoint.writer_lease import WriterLease
    from cadence.checkpoint.writer_turn import WriterTurn

logger = logging.getLogger("cadence.checkpoint")


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
        manifest -- and removes lease files expired for more than
        :data:`~cadence.checkpoint.cleanup.STALE_LEASE_GRACE` seconds (dead readers'; unexpired
        ones are never touched). False for readers (sidecar evaluators, tools): nothing on disk is
        changed, and :meth:`save`, :meth:`mark_final` and :meth:`clear_final` raise
        :class:`CheckpointError`. At most one writer per directory at a time: see ``fence``.
      fence: the model dir's writer lease this writer holds
        (:class:`~cadence.checkpoint.writer_lease.WriterLease`): checked right before each commit
        (the manifest write), each deletion (retention, :meth:`delete`, clean-up), moving aside,
        and FINAL; a lost lease raises :class:`~cadence.errors.WriterLeaseLostError` and nothing
        more is changed. Not released by this manager. None: no fencing (one writer is assumed).
      turn: a replica group's turn at the writer lease (:mod:`~cadence.checkpoint.writer_turn`;
        ``fence`` is then its lease): while a peer group holds it, this writer is a *standby* that
        changes nothing (:meth:`save`, :meth:`begin`, :meth:`mark_final`, :meth:`clear_final` do
        nothing; :meth:`delete`, :meth:`quarantine` raise) and tries to take it at each of them
        (:meth:`my_turn`).
      async_save: True: :meth:`save` returns once the objects are snapshotted into memory (an
        object's ``snapshot_checkpoint()`` when it has one, see :mod:`cadence.checkpoint.protocol`);
        a background thread writes and commits (same protocol). At most one save is in flight: the
        next :meth:`save` waits for it. A failed background save is raised (as
        :class:`CheckpointError`) by the next :meth:`save`, :meth:`wait` or
        :meth:`raise_if_failed`. :meth:`close` (and interpreter exit: the thread is not a daemon)
        waits for the pending commit. ``"auto"``: each save is synchronous or asynchronous by the
        measured cost of the last one (see :mod:`cadence.checkpoint.save_mode`; :meth:`asynchronous`).
      state_size: with ``async_save="auto"``, an estimate of the bytes a save writes, which decides
        the first save (see :mod:`cadence.checkpoint.save_mode`).
      checksum: the algorithm of the checksums new manifests record
        (:data:`~cadence.checkpoint.checksum.ALGORITHMS`; CRC32C by default). Reading verifies
        each file with the algorithm its manifest names, whatever this is.

    Each object saved or restored under a name is either *Checkpointable* (``save_checkpoint`` /
    ``load_checkpoint``) or *Stateful* (``state_dict`` / ``load_state_dict``), see
    :mod:`cadence.checkpoint.protocol`; the Checkpointable methods win when both exist.

    Retention honours readers' leases in ``directory/.leases/`` (:attr:`leases`; see
    :func:`cadence.checkpoint.retention.apply`); ``.leases/`` is not a checkpoint: listing, restoring
    and clean-up ignore it. :meth:`delete` is an explicit request and ignores leases.

    Retention runs after each commit on a helper thread (not a daemon), in the background of a
    synchronous save too: :meth:`steps`, :meth:`wait` and every change to the directory (the next
    save included) wait for it first; a lost writer lease it met is raised by the next
    :meth:`save`, :meth:`wait` or :meth:`raise_if_failed`.
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int | None = retention.DEFAULT_MAX_TO_KEEP, keep_every_n_steps: int | None = None,
        storage_options: dict[str, Any] | None = None, protected_steps: Callable[[], Iterable[int]] | None = None,
        writer: bool = True, async_save: AsyncSave = False, fence: WriterLease | None = None,
        checksum: str = checksum_lib.DEFAULT_ALGORITHM, state_size: StateSize | None = None,
        turn: WriterTurn | None = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 0):
            raise ValueError(f"max_to_keep must be None or an int >= 0, got {max_to_keep!r}")
        if keep_every_n_steps is not None and (not isinstance(keep_every_n_steps, int) or keep_every_n_steps < 1):
            raise ValueError(f"keep_every_n_steps must be None or an int >= 1, got {keep_every_n_steps!r}")
        self.directory, self.max_to_keep, self.keep_every_n_steps = directory, max_to_keep, keep_every_n_steps
        self.protected_steps, self.writer, self.async_save = protected_steps, writer, async_save
        self.save_mode = SaveMode(async_save, state_size=state_size)  # ValueError for another value
        self.turn, self.fence = turn, (turn.lease if turn is not None else fence)
        checksum_lib.new(checksum)  # ValueError naming the known algorithms
        self.checksum = checksum
        self._background = BackgroundSave()
        self._retention = BackgroundSave()  # the retention pass after the last commit
        self._decided: tuple[int, bool] | None = None  # (step, asynchronous) of the save about to be made
        self._just_committed: list[tuple[int, str]] = []  # appended by the saving thread, taken by take_committed()
        self._committed_here: set[int] = set()  # steps this manager committed: known good
        self._begun: dict[int, str] = {}  # step -> its work dir, from begin() until save()
        self.storage = Storage(directory, storage_options)
        self.leases = Leases(directory, storage_options=storage_options)
        self._committer = Committer(self.storage)
        if writer and (turn is None or self.fence is not None):
            self._clean_up()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, writer={self.writer})"

    # -- listing -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending: ``ckpt-<step>`` dirs with a manifest.

        Cheap (no hashing): a listed checkpoint may still turn out corrupt when read. Empty when
        ``directory`` does not exist yet. Waits for this manager's retention pass in flight.
        """
        self._retention.join()
        return listing.committed_steps(self.storage)

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
        listing.require_committed(self.storage, step)
        return manifest_lib.read(self.storage, self._dir(step), step)

    def read_state(self, step: int) -> dict[str, Any]:
        """The ``state.json`` of committed checkpoint ``step`` (checked against the manifest).

        Raises as :meth:`manifest`, and :class:`CorruptCheckpointError` when ``state.json`` does
        not match the manifest or is not a valid state document.
        """
        manifest = self.manifest(step)
        data = manifest_lib.read_verified(self.storage, self._dir(step), manifest, STATE_NAME)
        return restore.parse_state(self.storage, data, step)

    def info(self, step: int) -> dict[str, Any]:
        """``{"step", "time", "size", "files", "ranks", "path"}`` of checkpoint ``step`` from its manifest
        alone (``size``: total bytes; ``files``: how many; ``ranks``: how many ranks wrote them, more than
        one for a sharded checkpoint). Raises as :meth:`manifest`."""
        return {"step": step, **manifest_lib.summary(self.manifest(step)), "path": self.path(step)}

    # -- saving --------------------------------------------------------------------------------

    def save(self, step: int, objects: Mapping[str, object]) -> str:
        """Commit checkpoint ``step`` holding ``objects`` and apply retention (on a helper thread,
        see the class doc); return its path.

        An asynchronous save (:meth:`asynchronous`) returns once ``objects`` are snapshotted; see
        the class doc.
        """
        self.wait()  # one save in flight at most; raises a previous failure
        step = check_step(step)
        if not self.my_turn():
            return self.path(step)  # a standby: the writer commits this step
        asynchronous = self.asynchronous(step)
        self._decided = None
        if not asynchronous:
            return self._save_now(step, objects, retain_later=True)
        self._require_writer("save")
        if self._already_saved(step):
            return self.path(step)
        snapshot = snapshot_objects(step, objects)
        self._background.start(f"cadence-save-{step}", lambda: self._save_now(step, snapshot))
        return self.path(step)

    def asynchronous(self, step: int) -> bool:
        """Whether the save of ``step`` is asynchronous: ``async_save``, or with ``"auto"`` the
        choice made now from the last save's measured cost (kept for this step's :meth:`save`).
        Called before a sharded save, so that every rank writes its shards the same way."""
        if self._decided is None or self._decided[0] != step:
            self._decided = (step, self.save_mode.asynchronous())
        return self._decided[1]

    def begin(self, step: int) -> str | None:
        """Start checkpoint ``step`` for a sharded save: create the directory every rank writes
        its files into (``ckpt-N.tmp-<hex>/`` on local disks, ``ckpt-N/`` on object stores) and
        return its location (a path or URL); the next :meth:`save` of ``step`` commits it. None
        when ``step`` is already committed (nothing to write). Writers only."""
        step = check_step(step)
        if not self.my_turn():
            return None  # a standby: the writer commits this step
        self._require_writer("save")
        if self._already_saved(step):
            return None
        self.abandon(step)  # an earlier begin() never saved
        try:
            self._begun[step] = self._committer.new_work_dir(step, self.fence)
        except BaseException as e:
            raise_if_full(e, self.storage, f"save checkpoint step {step}")
            raise
        return self.storage.url(self._begun[step])

    def abandon(self, step: int) -> None:
        """Remove the directory :meth:`begin` created for ``step`` (the ranks' write failed);
        nothing happens when there is none."""
        work = self._begun.pop(step, None)
        if work is not None:
            self._committer.discard_failed(work, self._dir(step))

    def wait(self) -> None:
        """Block until an asynchronous save in flight is committed and the retention pass after
        the last commit is done; raise their failure."""
        self._background.join()
        self._retention.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckpointError` if a finished asynchronous save failed, and the
        :class:`~cadence.errors.WriterLeaseLostError` a finished retention pass met (does not block)."""
        error = self._background.take_error()
        if error is not None:
            kind = CheckpointSpaceError if isinstance(error, CheckpointSpaceError) else CheckpointError
            raise kind(f"asynchronous checkpoint save failed: {error}") from error
        error = self._retention.take_error()
        if error is not None:
            raise error

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

    def _save_now(self, step: int, objects: Mapping[str, object], *, retain_later: bool = False) -> str:
        """Commit checkpoint ``step`` holding ``objects`` and apply retention (``retain_later``: on
        a helper thread, see the class doc); return its path.

        Each object with ``save_checkpoint(writer)`` writes its files through the writer and its
        return value (JSON) is stored under its name in ``state.json``; an object with only
        ``state_dict()`` has that stored instead; any other object raises ``TypeError`` before
        anything is written. Bad, duplicate or reserved file names (``state.json``,
        ``MANIFEST.json``) raise ``ValueError``; a state that is not JSON raises ``TypeError``.

        The commit follows the protocol of :mod:`cadence.checkpoint.commit` (files, then the
        manifest last; a claim first on stores without atomic rename, so a step is committed at
        most once): until the manifest exists the checkpoint is invisible to :meth:`steps` and
        :meth:`restore`. The ``fence`` is checked right before the manifest is written.

        A step started with :meth:`begin` is committed from the directory it created, where the
        ranks of a sharded save wrote their files (added to the manifest by the objects, see
        :meth:`~cadence.checkpoint.protocol.CheckpointWriter.add_files`).

        If ``ckpt-N`` is already committed and verifies, nothing is written and its path is
        returned; one that does not verify is moved aside (:meth:`quarantine`) and saved anew. If
        saving raises, what was written is removed and the exception propagates: no checkpoint
        appears. A committed checkpoint (one with a manifest: another writer's) is never removed
        on that path.
        """
        step = check_step(step)
        self._require_writer("save")
        committer, final_dir = self._committer, self._dir(step)
        begun = self._begun.pop(step, None)
        if self._already_saved(step):
            logger.debug("checkpoint %s is already committed; not saving again", self.path(step))
            if begun is not None:
                committer.discard_failed(begun, final_dir)
            return self.path(step)
        for name, obj in objects.items():
            if not isinstance(obj, (Savable, Stateful)):
                if begun is not None:
                    committer.discard_failed(begun, final_dir)  # as after any failed save: nothing left behind
                raise TypeError(f"cannot checkpoint {name!r}: {type(obj).__name__} has neither save_checkpoint nor state_dict")
        work = begun if begun is not None else final_dir
        owned = begun is not None  # work is this save's to remove on failure (not another writer's)
        start = time.perf_counter()
        try:
            if begun is None:
                work = committer.new_work_dir(step, self.fence)
                owned = True
            writer = committer.write_files(work, step, objects, self.checksum)
            document = manifest_lib.build(step, writer.written(), algorithm=self.checksum, ranks=writer.ranks())
            committer.commit(step, work, writer, manifest_lib.encode(document),  # the fence, right before the commit
                             check=lambda: self._require_writer(f"commit checkpoint {self.path(step)}"))
        except BaseException as e:
            if owned:
                committer.discard_failed(work, final_dir)
            raise_if_full(e, self.storage, f"save checkpoint step {step}")
            raise
        self.save_mode.record(time.perf_counter() - start)
        logger.info("saved checkpoint %s", self.path(step))
        self._just_committed.append((step, self.path(step)))
        self._committed_here.add(step)
        if retain_later:
            self._retention.start(f"cadence-retention-{step}", lambda: self._apply_retention(step))
        else:
            self._apply_retention(step)
        return self.path(step)

    # -- retention -----------------------------------------------------------------------------

    def _apply_retention(self, just_saved: int) -> None:
        if self.max_to_keep is not None:  # None keeps everything: no need to read the leases
            retention.apply(self.storage, self.leases, just_saved, max_to_keep=self.max_to_keep,
                            keep_every_n_steps=self.keep_every_n_steps, extra=self.protected_steps,
                            check=self._require_writer, delete=self._delete, path=self.path)

    def delete(self, step: int) -> None:
        """Delete committed checkpoint ``step``: its manifest first (readers stop seeing it at
        once), then its directory. Raises :class:`CheckpointError` when it is not committed or
        this manager is a reader."""
        self.wait()
        step = check_step(step)
        self._require_writer("delete")
        listing.require_committed(self.storage, step)
        self._delete(step)

    def _delete(self, step: int) -> None:
        cleanup.delete_committed(self.storage, step)

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
        (naming its path and the reason) and skipped for the one before it (a writer moves it
        aside: :meth:`quarantine`); when every committed checkpoint is bad,
        :class:`CheckpointError` is raised rather than starting from scratch.
        Explicit ``step``: :class:`CheckpointError` (listing the available steps) when it is not
        committed, :class:`CorruptCheckpointError` when it is bad.

        Errors raised by the objects' own loading (e.g. ``UnsafeCheckpointError``) propagate
        unchanged, with no fall-back.
        """
        self.wait()
        restore.check_restorable(objects)
        if step is None:
            moves = self.writer and (self.turn is None or self.fence is not None)  # a standby moves nothing
            loaded = restore.load_latest(self.storage, coordinator, self.quarantine if moves else None)
            if loaded is None:
                return None
        else:
            step = check_step(step)
            listing.require_committed(self.storage, step)
            loaded = restore.load(self.storage, step, coordinator)
        reader, state = loaded
        restore.apply(objects, reader, state)
        logger.info("restored checkpoint %s", reader.path)
        return reader.step

    def read(self, step: int) -> tuple[VerifiedReader, dict[str, Any]]:
        """Read and verify every file of committed checkpoint ``step``: ``(reader, state.json)``.

        Changes nothing. Raises :class:`CheckpointError` when ``step`` is not committed and
        :class:`CorruptCheckpointError` when its files do not match the manifest.
        """
        step = check_step(step)
        listing.require_committed(self.storage, step)
        return restore.load(self.storage, step)

    # -- FINAL ---------------------------------------------------------------------------------

    def mark_final(self, step: int, reason: str | None = None) -> None:
        """Record (atomically) that training completed at committed checkpoint ``step``; a
        ``FINAL`` naming ``step`` already is left as it is (its time says when training ended).
        ``reason``: why training stopped there before its target (an action's stop: early
        stopping, a sweep's pruner), written as ``FINAL``'s ``reason``; None: none written.

        Raises :class:`CheckpointError` when ``step`` is not committed or this is a reader.
        """
        self.wait()  # FINAL names a committed checkpoint
        step = check_step(step)
        if not self.my_turn():
            return  # a standby: the writer marks it
        self._require_writer("mark_final")
        listing.require_committed(self.storage, step)
        if self.final_step() != step:
            final.write_final(self.storage, step, reason)

    def final_step(self) -> int | None:
        """The step named by ``FINAL``, or None when there is none (an unreadable one is warned about)."""
        return final.read_final_step(self.storage)

    def clear_final(self) -> None:
        """Remove ``FINAL`` (training continues past it); nothing happens when there is none (nor on a standby)."""
        if not self.my_turn():
            return
        self._require_writer("clear_final")
        final.remove_final(self.storage)

    # -- quarantine ----------------------------------------------------------------------------

    def quarantine(self, step: int, reason: str) -> str:
        """Move checkpoint ``step``, which does not verify, aside to ``ckpt-<step>.corrupt-<UTC
        time>-<hex>/`` -- kept for inspection, never deleted, no longer listed -- so that the step
        can be saved anew. Returns where it went (a path or URL). Writers only."""
        self._require_writer("move aside")
        target = cleanup.quarantine(self.storage, step, reason)
        self._committed_here.discard(step)
        return target

    def quarantined(self) -> list[str]:
        """The checkpoints moved aside because they did not verify (:meth:`quarantine`), by name."""
        return listing.quarantined(self.storage)

    # -- internals -----------------------------------------------------------------------------

    def _dir(self, step: int) -> str:
        return listing.step_dir(self.storage, step)

    def _already_saved(self, step: int) -> bool:
        """Whether ``ckpt-<step>`` is committed and good: committed by this manager, or verified
        now (a corrupt one is moved aside, and False returned)."""
        if not listing.has_manifest(self.storage, f"ckpt-{step}"):
            return False
        if step in self._committed_here:
            return True
        try:
            restore.load(self.storage, step)
        except CorruptCheckpointError as e:
            self.quarantine(step, e.reason)
            return False
        self._committed_here.add(step)
        return True

    def my_turn(self) -> bool:
        """Whether this writer changes the directory now: always without ``turn``; with it, once it
        holds the lease (taken now when free; the previous writer's leftovers are then cleaned up)."""
        if self.turn is not None and self.fence is None and self.turn.take() is not None:
            self.fence = self.turn.lease
            self._clean_up()
        return self.turn is None or self.fence is not None

    def _clean_up(self) -> None:
        self.storage.makedirs(self.storage.root)
        self._require_writer("clean up after interrupted saves")
        cleanup.clean_up(self.storage, self.leases)

    def _require_writer(self, what: str) -> None:
        """Raise unless this manager may change the directory now: a writer, holding ``fence``."""
        if not self.writer:
            raise CheckpointError(f"{what}: this manager of {self.directory} is a reader (writer=False)")
        if self.turn is not None and self.fence is None:
            raise CheckpointError(f"{what}: replica {self.turn.group} stands by: another group writes {self.directory}")
        if self.fence is not None:
            self.fence.check(what)
