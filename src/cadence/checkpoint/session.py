"""A run's checkpoints, as the :class:`~cadence.Controller` uses them: :class:`CheckpointSession`.

Restore on start, save (a collective in a multi-process job), the final checkpoint and
``FINAL``, rollback (NaN recovery), the branch check, and telling the callbacks about the
commits of asynchronous saves. Without a checkpoint manager every operation is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from cadence.checkpoint.manager import CheckpointManager
from cadence.checkpoint.protocol import CheckpointReader
from cadence.coordination import Coordinator
from cadence.errors import CheckpointError

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
    """

    def __init__(self, manager: CheckpointManager | None, coordinator: Coordinator, *,
                 on_save: PathHook, on_load: PathHook) -> None:
        self.manager = manager
        self.coordinator = coordinator
        self._on_save = on_save
        self._on_load = on_load

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
        restored = self.manager.restore(objects, step)
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
        restored = self.manager.restore({"trainer": RollbackTrainer(trainer)})
        if restored is None:
            raise CheckpointError(f"cannot roll back: no committed checkpoint in {self.manager.directory}")
        self._on_load(self.manager.path(restored))
        return restored

    # ------------------------------------------------------------------ save

    def save(self, step: int, objects: Callable[[], Mapping[str, object]], prepare: Callable[[], None]) -> str | None:
        """Collective: ``prepare()`` on every rank, then the chief commits ``objects()`` at
        ``step``; every rank returns once it is committed. Saving a step twice writes once.
        The checkpoint's path; None without a manager."""
        if self.manager is None:
            return None
        prepare()
        path = self.manager.path(step)
        if self.coordinator.is_chief:
            # An asynchronous save in flight is waited for by save() anyway: report it first,
            # before the next commit's retention may delete it.
            self.wait_for_commits()
            path = self.manager.save(step, objects())
        self.coordinator.barrier()  # no rank goes on before the checkpoint is committed
        self.report_commits()
        return path

    def complete(self, step: int, save: Callable[[], object]) -> None:
        """The run is complete at ``step``: ``save()`` its checkpoint, then mark it ``FINAL``."""
        if self.manager is None:
            return
        save()
        if self.coordinator.is_chief:
            self.manager.mark_final(step)  # waits for an asynchronous commit
        self.report_commits()

    def reopen_if_final(self, target: int | None) -> None:
        """A run marked FINAL that trains on past its final step (``target`` None: until the data
        runs out) is no longer final: the chief removes the marker."""
        if self.manager is None or not self.coordinator.is_chief:
            return
        final = self.manager.final_step()
        if final is not None and (target is None or target > final):
            self.manager.clear_final()

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
        """Wait for a pending asynchronous save (raising its failure) and report the commits."""
        if self.manager is None:
            return
        self.manager.close()
        self.report_commits()
