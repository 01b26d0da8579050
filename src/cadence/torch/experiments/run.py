"""One process's run of an experiment config: :func:`build_run` assembles the task, runners,
actions, callbacks, checkpoint manager and controller (:class:`Run`), after taking the model dir's
writer lease (:func:`acquire_writer_lease`) for a training run, and checking that every rank sees
it (:func:`~cadence.checkpoint.shared_dir.check_shared`). A training run refused by bad input
before it trained or evaluated anything leaves the model dir as it found it
(:mod:`cadence.checkpoint.footprint`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.footprint import ModelDirFootprint, check_training_paths, is_refusal
from cadence.checkpoint.shared_dir import check_shared
from cadence.checkpoint.writer_lease import WriterLease
from cadence.checkpoint.writer_turn import WriterTurn
from cadence.config import ExperimentConfig
from cadence.errors import WriterLeaseHeldError
from cadence.loop.controller import Controller
from cadence.runtime.coordination import Coordinator, LocalCoordinator
from cadence.runtime.watchdog import Heartbeat, Watchdog
from cadence.torch.checkpoint_io.state_size import StateSizeEstimate
from cadence.torch.components.ema import ModelEMA
from cadence.torch.experiments.actions import build_actions
from cadence.torch.experiments.callbacks import build_callbacks, tracking_callbacks
from cadence.torch.experiments.external import with_external_evaluators
from cadence.torch.experiments.intervals import StepIntervals, resolve_intervals
from cadence.torch.experiments.runners import build_runners_from_config
from cadence.torch.loop.trainer import TorchTrainer
from cadence.torch.runtime.context import Context
from cadence.torch.task.task import Task

__all__ = ["Run", "acquire_writer_lease", "build_run", "take_writer_turn"]

T = TypeVar("T")


@dataclass
class Run:
    """Everything one process needs to train and/or evaluate an experiment."""

    config: ExperimentConfig
    task: Task
    ctx: Context
    controller: Controller
    checkpoint_manager: CheckpointManager
    model: Any
    writer_lease: WriterLease | None = None
    """The chief's writer lease on the model dir taken at the start; None on other ranks, readers,
    and a replica group that stands by."""
    writer_turn: WriterTurn | None = None
    """A fault-tolerant replica group's chief: its turn at the run's writer lease (it may take the
    lease at a later checkpoint, :mod:`cadence.checkpoint.writer_turn`); None otherwise."""
    watchdog: Watchdog | None = None
    """This rank's hang watchdog while it trains (``trainer.hang_timeout``); None: off."""
    ema: ModelEMA | None = None
    """The EMA of the weights (``trainer.ema``): what is evaluated and exported; None: off."""
    footprint: ModelDirFootprint | None = None
    """What the chief's training run found in the model dir, to take back when it is refused."""
    intervals: StepIntervals = field(default_factory=lambda: StepIntervals(None, None, 1))
    """The checkpoint and validation intervals in steps (``trainer.*_interval``, epochs converted)."""
    started_at: tuple[int, int | None] = (0, None)
    """The global step and the last evaluation's step once built: a run still there has neither
    trained nor evaluated."""

    @property
    def model_dir(self) -> str:
        """Where this process writes its outputs: the model dir, or a replica group's own directory
        (:func:`~cadence.layout.replica_group_dir`; the checkpoints are in the run's model dir)."""
        return self.config.require_model_dir()

    def release(self, error: BaseException | None = None) -> None:
        """Stop the watchdog and release the writer lease (the next trainer of the model dir may
        start at once); idempotent. ``error``: what ended the run; bad input
        (:func:`~cadence.checkpoint.footprint.is_refusal`) before the run trained or evaluated
        anything takes back what it changed in the model dir, its lease file included
        (:meth:`~cadence.checkpoint.footprint.ModelDirFootprint.undo`)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if isinstance(self.controller.trainer, TorchTrainer):
            self.controller.trainer.close_data()
            if self.controller.trainer.replicas is not None:  # leaves the replica groups' quorum
                self.controller.trainer.replicas.close()
        if self.footprint is not None and is_refusal(error) and self._untouched():
            self.footprint.undo(self.writer_lease)  # a standing-by replica group: its own directory
        if self.writer_lease is not None:
            self.writer_lease.release()  # a no-op once withdrawn
        if self.writer_turn is not None:  # the lease it took later, if any
            self.writer_turn.release()

    def _untouched(self) -> bool:
        return (self.controller.global_step, self.controller.last_eval_step) == self.started_at

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.release(exc)


def build_run(cfg: ExperimentConfig, *, train: bool = True, evaluate: bool = True,
              restore_step: int | None = None, progress: bool | None = None, restore: bool = True,
              restore_from: str | None = None) -> Run:
    """Seed, build the task, runners, actions and callbacks (:func:`build_callbacks`), and a
    controller that restores the latest checkpoint.

    ``train=False`` builds an evaluator-only run that reads checkpoints without changing the
    model directory (``restore_step``: that checkpoint; ``None``: the latest); it runs no actions,
    and its callbacks hear of the restore, the evaluation and the close only. ``restore=False``:
    no checkpoint is read (the model as built: ``cadence evaluate --initial``). ``restore_from``: the
    directory of checkpoints an evaluator-only run reads (default: the model dir's ``checkpoints/``;
    ``best/`` for ``cadence evaluate --checkpoint best``).

    A training run's chief first takes the model dir's writer lease (:func:`acquire_writer_lease`;
    :class:`~cadence.errors.WriterLeaseHeldError` when another trainer holds it), which
    :attr:`Run.writer_lease` keeps until :meth:`Run.release` (``with run:``). With several ranks,
    every rank then reads the lease back (:func:`~cadence.checkpoint.shared_dir.check_shared`;
    :class:`~cadence.errors.ModelDirNotSharedError` on every rank when one does not see the
    chief's model dir), before anything is restored.

    A fault-tolerant replica group (``trainer.fault_tolerance``) trains the run of the model dir
    with the other groups: its chief takes its turn at the writer lease instead
    (:func:`take_writer_turn`; it stands by while a peer group holds it), its checkpoints are the
    model dir's, and group ``r > 0`` writes its own outputs (metrics, events, ``config.yaml``...) into
    :func:`~cadence.layout.replica_group_dir` (:attr:`Run.config`'s ``model_dir``).

    A training run refused by bad input (:func:`~cadence.checkpoint.footprint.is_refusal`: a
    checkpoint that does not fit the model, a model dir not shared, ...) here, or later before it
    trained or evaluated anything (:meth:`Run.release`), leaves the model dir as it found it:
    the chief notes it around taking the lease (:class:`~cadence.checkpoint.footprint.ModelDirFootprint`).
    """
    if train and restore_from is not None:
        raise ValueError("build_run: restore_from is for an evaluator-only run (train=False)")
    model_dir = layout.check_model_dir(cfg.require_model_dir())
    if train:  # checkpoints/ a file: one line now, before anything is written
        check_training_paths(model_dir)
    task, ctx, trainer, evaluator = build_runners_from_config(cfg, train=train, evaluate=evaluate)
    replica = train and cfg.trainer.fault_tolerance is not None
    outputs = cfg  # where this process writes its own outputs: a replica group's own directory
    if replica:
        outputs = cfg.model_copy(update={"model_dir": layout.replica_group_dir(model_dir, ctx.replica_group)})
    evaluator = with_external_evaluators(cfg, task, evaluator, "train" if train else "evaluate",
                                         layout.eval_dir(outputs.require_model_dir()) if train else None)
    intervals = StepIntervals(None, None, cfg.trainer.steps_per_loop)
    if trainer is not None:  # the training input now: a bad batch size, an interval in epochs without a len(),
        intervals = resolve_intervals(cfg.trainer, trainer.plan().batches_per_epoch)  # fail before the model dir is written
    footprint = ModelDirFootprint(model_dir) if train and ctx.is_chief else None
    turn = take_writer_turn(cfg, ctx.coordinator, ctx.replica_group) if replica else None
    if replica:  # the chief's turn (None on the other ranks, which never commit)
        lease = turn.lease if turn is not None else None
    else:
        lease = acquire_writer_lease(cfg, ctx.coordinator) if train else None
    if replica and lease is None:  # standing by: a refusal takes back group r > 0's own directory only
        footprint = None
        if ctx.is_chief and ctx.replica_group > 0:
            footprint = ModelDirFootprint(outputs.require_model_dir(),
                                          parents=(layout.join(model_dir, layout.REPLICAS), model_dir))
            footprint.held()
    watchdog = None
    try:
        if lease is not None and footprint is not None:
            footprint.held()
        if train and ctx.coordinator is not None:  # before the restore: a rank must not read another model dir
            check_shared(cfg.require_model_dir(), ctx.coordinator, lease.record if lease is not None else None)
        if train and cfg.trainer.hang_timeout is not None:  # from before the restore (a collective that may hang)
            ctx.heartbeat = Heartbeat()
            watchdog = Watchdog(ctx.heartbeat, cfg.trainer.hang_timeout, rank=ctx.rank).start()
        run = _assemble_run(outputs, task, ctx, trainer, evaluator, lease, intervals,
                            train=train, evaluate=evaluate, restore_step=restore_step, progress=progress,
                            restore=restore, restore_from=restore_from, run_dir=model_dir, turn=turn)
    except BaseException as e:
        if watchdog is not None:
            watchdog.stop()
        if footprint is not None and is_refusal(e):
            footprint.undo(lease)
        if lease is not None:
            lease.release()  # a no-op once withdrawn
        if turn is not None:
            turn.release()
        raise
    run.watchdog, run.writer_turn = watchdog, turn
    run.footprint = footprint
    run.started_at = (run.controller.global_step, run.controller.last_eval_step)
    return run


def acquire_writer_lease(cfg: ExperimentConfig, coordinator: Coordinator | None) -> WriterLease | None:
    """The chief's writer lease on the model dir (None on the other ranks, which never commit).

    A collective: the chief acquires; when it cannot, every rank raises the same
    :class:`~cadence.errors.WriterLeaseHeldError`, so the whole job stops before writing anything.
    """
    return _on_the_chief(coordinator, lambda: WriterLease.acquire(cfg.require_model_dir(),
                                                                  ttl=cfg.checkpoint.writer_lease_ttl))


def take_writer_turn(cfg: ExperimentConfig, coordinator: Coordinator | None, group: int) -> WriterTurn | None:
    """Replica group ``group``'s turn at the run's writer lease (None on the ranks but the chief):
    group 0 takes the lease now when it is free, the others stand by until their first checkpoint
    (:class:`~cadence.checkpoint.writer_turn.WriterTurn`). A collective, as :func:`acquire_writer_lease`:
    every rank raises the same :class:`~cadence.errors.WriterLeaseHeldError` when a live trainer that
    is no replica group holds the lease."""
    return _on_the_chief(coordinator, lambda: WriterTurn.start(cfg.require_model_dir(), f"group{group}",
                                                               ttl=cfg.checkpoint.writer_lease_ttl, first=group == 0))


def _on_the_chief(coordinator: Coordinator | None, take: Callable[[], T]) -> T | None:
    """``take()`` on the chief, None on the other ranks; a collective: when the chief's raised
    :class:`~cadence.errors.WriterLeaseHeldError`, every rank raises the same."""
    coordinator = coordinator or LocalCoordinator()
    taken, refusal = None, None
    if coordinator.is_chief:
        try:
            taken = take()
        except WriterLeaseHeldError as e:
            refusal = str(e)
    refusal = coordinator.broadcast(refusal)
    if refusal is not None:
        raise WriterLeaseHeldError(refusal)
    return taken


def _assemble_run(cfg: ExperimentConfig, task: Task, ctx: Context, trainer: Any, evaluator: Any,
                  lease: WriterLease | None, intervals: StepIntervals, *, train: bool, evaluate: bool,
                  restore_step: int | None, progress: bool | None, restore: bool = True,
                  restore_from: str | None = None, run_dir: str, turn: WriterTurn | None = None) -> Run:
    """``cfg``'s model dir: where this process writes its outputs; ``run_dir``: the run's model dir,
    whose checkpoints it restores and saves (with ``turn``: when its replica group holds the lease)."""
    model_dir = cfg.require_model_dir()
    t = cfg.trainer
    model = (trainer or evaluator).model
    ema = (trainer or evaluator).ema
    train_actions, eval_actions = (
        build_actions(cfg, task, model, train=train, evaluate=evaluate, chief=ctx.is_chief, ema=ema)
        if train else ([], [])
    )
    callbacks = build_callbacks(cfg, task)
    if train:  # a one-off evaluation (cadence evaluate --checkpoint) logs into no tracker
        export_on = cfg.export.on if cfg.export is not None else None
        exports = export_on if export_on == "final" or (evaluate and export_on is not None) else None
        callbacks += tracking_callbacks(cfg, ctx.is_chief, export=exports)
    if train and ema is not None:  # updated after each step (after the user's callbacks: their positions stay)
        callbacks.append(ema)
    if train and cfg.profiler is not None:
        from cadence.torch.components.profiling import build_step_profiler

        callbacks.append(build_step_profiler(cfg.profiler, model_dir, ctx, train_steps=t.train_steps))
    manager = CheckpointManager(  # one writer: the chief; the other ranks only read
        restore_from or layout.checkpoints_dir(run_dir), max_to_keep=t.max_to_keep,
        keep_every_n_steps=t.keep_every_n_steps, writer=train and ctx.is_chief,
        async_save=cfg.checkpoint.async_save if train else False, fence=lease, checksum=cfg.checkpoint.checksum,
        state_size=StateSizeEstimate(model, trainer.optimizer, ema) if train else None, turn=turn,
    )
    controller = Controller(
        trainer=trainer,
        evaluator=evaluator,
        checkpoint_manager=manager,
        steps_per_loop=intervals.steps_per_loop if train else None,
        checkpoint_interval=intervals.checkpoint,
        summary_interval=t.summary_interval,
        summary_dir=layout.train_dir(model_dir) if train else None,
        eval_summary_dir=layout.eval_dir(model_dir) if train else None,
        train_actions=train_actions,
        eval_actions=eval_actions,
        callbacks=callbacks,
        restore_step=restore_step,
        restore=restore,
        progress=progress,
        coordinator=ctx.coordinator,
        heartbeat=ctx.heartbeat,
    )
    return Run(config=cfg, task=task, ctx=ctx, controller=controller, checkpoint_manager=manager, model=model,
               writer_lease=lease, ema=ema, intervals=intervals)
