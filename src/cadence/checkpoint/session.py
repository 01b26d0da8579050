"""A run's checkpoints, as the :class:`~cadence.Controller` uses them: :class:`CheckpointSession`.

Restore on start, save (a collective in a multi-process job), the final checkpoint and
``FINAL``, rollback (NaN recovery), the branch check, telling the callbacks about the commits of
asynchronous saves, and committing the trained steps before an error of user code propagates
(:meth:`CheckpointSession.commit_on_error`). Without a checkpoint manager every operation is a no-op.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from cadence.checkpoint.copy import JSONState
from cadence.checkpoint.manager import CheckpointManager
from cadence.checkpoint.protocol import CheckpointReader, ShardTarget, WritesShards
from cadence.extensions import Stateful
from cadence.runtime.coordination import Coordinator
from cadence.errors import CheckpointError, TrainingDivergedError

logger = logging.getLogger("cadence")

__all__ = ["CheckpointSession", "RollbackTrainer"]

PathHook = Callable[[str], None]


class RollbackTrainer:
    """Restores a trainer's model and optimizer state but not its data position or RNG.

    The trainer's ``load_checkpoint`` must accept the keywords ``restore_data`` and
    ``restore_rng`` (``cadence.torch.TorchTrainer`` does)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def load_checkpoint(self, reader: CheckpointReader, state: Any) -> None:
        self.trainer.load_checkpoint(reader, state, restore_data=False, restore_rng=False)


class CheckpointSession:
    """Restores and saves a run's checkpoints through ``manager`` (``None``: no checkpoints).

    Args:
      manager: the run's checkpoint manager, or None.
      coordinator: the ranks of the job. The chief alone writes; every rank calls :meth:`save`
        and :meth:`complete`, which return once the checkpoint is committed.
      on_save: called with a checkpoint's path once it is committed (chief only; for
        asynchronous saves on the calling thread, when the commit is noticed).
      on_load: called with a checkpoint's path after it was restored, on every rank.
      shards: the trainer when its checkpoints are sharded (``writes_shards``): every rank then
        writes its files into the checkpoint's directory, which the chief creates
        (:meth:`CheckpointManager.begin`), before the chief commits (see :meth:`save`).
    """

    def __init__(self, manager: CheckpointManager | None, coordinator: Coordinator, *,
                 on_save: PathHook, on_load: PathHook, shards: WritesShards | None = None) -> None:
        self.manager = manager
        self.coordinator = coordinator
        self._on_save = on_save
        self._on_load = on_load
        self._shards = shards if shards is not None and shards.writes_shards else None

    # ------------------------------------------------------------------ restore

    def check_branch(self, restore_step: int | None) -> None:
        """Refuse to *train* from ``restore_step`` when later checkpoints exist: that would mix
        two runs in one directory. Raises ValueError."""
        if restore_step is None or self.manager is None:
            return
        later = [s for s in self.manager.steps() if s > restore_step]
        if later:
            raise ValueError(
                f"restore_step={restore_step} with a trainer, but checkpoints {later} exist after it: "
                "training from there would mix two runs in one model dir. Copy the checkpoint to a new "
                "model dir, or delete the later checkpoints first."
            )

    def restore(self, objects: Mapping[str, object], step: int | None = None) -> int | None:
        """Restore checkpoint ``step`` (None: the latest committed, falling back past corrupt ones)
        into ``objects``; the restored step, or None when there is nothing to restore.

        Raises:
          CheckpointError: ``step`` given and missing or corrupt.
        """
        if self.manager is None:
            return None
        restored = self.manager.restore(objects, step, coordinator=self.coordinator)
        if restored is not None:
            self._on_load(self.manager.path(restored))
        return restored

    def rollback(self, trainer: Any) -> int:
        """Restore the trainer's model state from the latest committed checkpoint, keeping its data
        position and RNG (see :class:`RollbackTrainer`); the step rolled back to.

        Raises:
          ValueError: no checkpoint manager.
          CheckpointError: no committed checkpoint.
        """
        if self.manager is None:
            raise ValueError("rollback needs a checkpoint manager; this controller was built without one")
        restored = self.manager.restore({"trainer": RollbackTrainer(trainer)}, coordinator=self.coordinator)
        if restored is None:
            raise CheckpointError(f"cannot roll back: no committed checkpoint in {self.manager.directory}")
        self._on_load(self.manager.path(restored))
        return restored

    # ------------------------------------------------------------------ save

    def save(self, step: int, objects: Callable[[], Mapping[str, object]], prepare: Callable[[], None]) -> str | None:
        """Collective: ``prepare()`` on every rank, then the chief commits ``objects()`` at
        ``step``; every rank returns once it is committed (an asynchronous save: once it is
        captured). Saving a step twice writes once. The checkpoint's path; None without a manager.

        A sharded save: the chief creates the checkpoint's directory and tells every rank, every
        rank writes its files there (``shards.write_shards``), then the chief commits, the
        manifest listing every rank's files.
        """
        if self.manager is None:
            return None
        prepare()
        path = self.manager.path(step)
        if self.coordinator.is_chief:
            # An asynchronous save in flight is waited for by save() anyway: report it first,
            # before the next commit's retention may delete it.
            self.wait_for_commits()
        if self._shards is not None:
            target = None
            if self.coordinator.is_chief:
                directory = self.manager.begin(step)
                if directory is not None:
                    target = ShardTarget(step, directory, self.manager.checksum, self.manager.asynchronous(step),
                                         self.manager.storage.options)
            target = self.coordinator.broadcast(target)
            if target is not None:
                try:
                    self._shards.write_shards(target)
                except BaseException:
                    if self.coordinator.is_chief:
                        self.manager.abandon(step)
                    raise
        if self.coordinator.is_chief:
            path = self.manager.save(step, objects())
        self.coordinator.barrier()  # no rank goes on before the checkpoint is committed
        self.report_commits()
        return path

    def complete(self, step: int, save: Callable[[], object], reason: str | None = None) -> None:
        """The run is complete at ``step``: ``save()`` its checkpoint, then mark it ``FINAL``
        (``reason``: why it stopped before its target -- an action's stop -- recorded in ``FINAL``)."""
        if self.manager is None:
            return
        save()
        if self.coordinator.is_chief:
            self.manager.mark_final(step, reason=reason)  # waits for an asynchronous commit
        self.report_commits()

    def reopen_if_final(self, target: int | None) -> None:
        """A run marked FINAL that trains on past its final step (``target`` None: until the data
        runs out) is no longer final: the chief removes the marker."""
        if self.manager is None or not self.coordinator.is_chief:
            return
        final = self.manager.final_step()
        if final is not None and (target is None or target > final):
            self.manager.clear_final()

    # ------------------------------------------------------------------ errors

    @property
    def commits_on_error(self) -> bool:
        """Whether :meth:`commit_on_error` may save: a manager, and a single-process run."""
        return self.manager is not None and self.coordinator.world_size == 1

    @contextmanager
    def commit_on_error(self, step: Callable[[], int], objects: Callable[[], Mapping[str, object]],
                        prepare: Callable[[], None], what: str) -> Iterator[None]:
        """Run the block; when it raises an ``Exception`` while the run is at a step past the
        latest checkpoint, commit ``objects()`` at ``step()`` first, then let the error propagate.

        For the user code the loop runs *between* training steps (evaluations, actions), when the
        trainer's state is that of a completed step: the steps trained since the last checkpoint
        are kept, and a run resumed from this checkpoint continues exactly. Not used around the
        trainer's own ``train()``: an error inside a training step leaves its state mid-step (the
        data iterator and the RNG already past the failing batch, gradients half accumulated), so
        a checkpoint of it would not resume exactly.

        Nothing is saved for a :class:`~cadence.errors.CheckpointError` (a failed write would fail
        again; a lost writer lease must not write), a
        :class:`~cadence.errors.TrainingDivergedError` (the state is the diverged one), a
        ``BaseException`` that is not an ``Exception`` (interrupts, exits: preemption saves on
        its own), nor in a multi-process run (:attr:`commits_on_error`): the save is a collective,
        and an error raised on one rank only would leave the others waiting in it. A failure of
        this save is logged; the block's own error propagates.
        """
        try:
            yield
        except Exception as error:
            self._commit_after(error, step(), objects, prepare, what)
            raise

    def _commit_after(self, error: Exception, step: int, objects: Callable[[], Mapping[str, object]],
                      prepare: Callable[[], None], what: str) -> None:
        if not self.commits_on_error or isinstance(error, (CheckpointError, TrainingDivergedError)):
            return
        assert self.manager is not None
        try:
            latest = self.manager.latest_step()
            if step <= (latest if latest is not None else 0):
                return  # nothing trained since the last checkpoint (or at all)
            path = self.save(step, objects, prepare)
            self.wait_for_commits()  # an asynchronous save is committed before the error goes on
        except Exception:
            logger.exception("%s failed at step %d, and committing that step failed too", what, step)
            return
        logger.warning("%s failed at step %d (%s): committed %s first; resuming continues from there",
                       what, step, type(error).__name__, path)

    @staticmethod
    def frozen(objects: Mapping[str, object]) -> dict[str, object]:
        """The :class:`~cadence.extensions.Stateful` ones of ``objects`` as they are now: a copy
        of each one's state, saved in its place (the checkpoint of a moment already past)."""
        return {name: JSONState(copy.deepcopy(obj.state_dict())) for name, obj in objects.items()
                if isinstance(obj, Stateful)}

    # ------------------------------------------------------------------ asynchronous commits

    def after_loop(self) -> None:
        """Raise a failed asynchronous save; report the commits finished during the loop."""
        if self.manager is None:
            return
        self.manager.raise_if_failed()
        self.report_commits()

    def report_commits(self) -> None:
        """Call ``on_save`` for each commit the manager finished since the last report."""
        if self.manager is None:
            return
        for _, path in self.manager.take_committed():
            self._on_save(path)

    def wait_for_commits(self) -> None:
        """Wait for an asynchronous save in flight, then report the commits."""
        if self.manager is None:
            return
        self.manager.wait()
        self.report_commits()

    def close(self) -> None:
        """Wait for a pending asynchronous save (raising its failure) and report the commits;
        every rank waits for its own shards of it."""
        if self.manager is None:
            return
        try:
            if self._shards is not None:
                self._shards.wait_for_shards()
        finally:
            self.manager.close()
        self.report_commits()
