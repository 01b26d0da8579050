"""The entry points that run an :class:`~cadence.config.ExperimentConfig`: train
(:func:`run_training`), evaluate (:func:`run_evaluation`), the sidecar (:func:`run_sidecar`), a backfill of
past checkpoints (:func:`run_backfill`) and export
(:func:`run_export`), laid out in the model directory (DESIGN.md's contract). The run they build is
assembled in the modules beside this one (:mod:`~cadence.torch.experiments.run`).

This is what ``cadence train`` and ``cadence evaluate`` call; it is also the short way to run a
config from Python::

    from cadence.config import load_config
    from cadence.torch import run_training
    metrics = run_training(load_config("examples/digits/config.yaml", model_dir="runs/digits"))
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.config import ExperimentConfig, save_config
from cadence.config.workdir import absolute_local, in_workdir
from cadence.errors import NoCheckpointError
from cadence.sidecar.evaluator import SidecarEvaluator, SidecarResult, check_backfill, check_name_free
from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.runtime.distributed import broadcast_unsharded
from cadence.torch.components.ema import applied
from cadence.torch.experiments.actions import build_actions
from cadence.torch.experiments.callbacks import build_callbacks, tracking_callbacks
from cadence.torch.experiments.external import with_external_evaluators
from cadence.torch.experiments.exporting import ModelExporter, example_inputs_for
from cadence.torch.experiments.run import Run, build_run
from cadence.torch.experiments.runners import build_runners_from_config, pretrained_loader

logger = logging.getLogger("cadence")

__all__ = ["build_sidecar", "run_backfill", "run_evaluation", "run_export", "run_sidecar", "run_training"]


def run_training(cfg: ExperimentConfig, *, progress: bool | None = None,
                 in_process_validation: bool | None = None) -> dict[str, Any]:
    """``train_and_evaluate`` the experiment in this process; return the last eval metrics.

    Resumes from the model dir's latest checkpoint if it has one, and writes the resolved
    ``config.yaml`` into it when there is something to train.
    First, ``trainer.sanity_val_steps`` validation batches check the
    validation code and the eval metrics the actions name (:func:`~cadence.loop.sanity.sanity_check`;
    a :class:`~cadence.errors.SanityCheckError` before any step); with ``trainer.eval_at_start``, a fresh
    run then evaluates step 0 (no eval action sees it). With ``export.on: final``,
    exports the final model. ``in_process_validation`` (default: ``trainer.in_process_validation``): False only trains,
    for a sidecar to evaluate; the result is then ``{}``. With ``cfg.workdir``, it runs there
    (:func:`~cadence.config.workdir.in_workdir`); the config written records the directory it ran in.
    """
    with in_workdir(cfg) as cfg:
        if in_process_validation is None:
            in_process_validation = cfg.trainer.in_process_validation
        if not in_process_validation:
            return _train_only(cfg, progress)
        return _train_and_evaluate(cfg, progress)


def _train_and_evaluate(cfg: ExperimentConfig, progress: bool | None) -> dict[str, Any]:
    run = build_run(cfg, progress=progress)
    t = cfg.trainer
    sanity_steps = t.sanity_val_steps if t.validation_steps == -1 else min(t.sanity_val_steps, t.validation_steps)
    # the controller closes (commits) before the lease goes; bad input before any step leaves nothing (Run.release)
    with run, run.controller as controller:
        export_final = (
            ModelExporter(run.config, run.task, run.model, "final", chief=run.ctx.is_chief, ema=run.ema)
            if cfg.export is not None and cfg.export.on == "final" else None
        )
        _save_config_if_training(cfg, run)
        metrics = controller.train_and_evaluate(
            train_steps=t.train_steps, eval_steps=t.validation_steps, eval_interval=run.intervals.validation,
            throttle_secs=cfg.eval_spec.throttle_secs, start_delay_secs=cfg.eval_spec.start_delay_secs,
            sanity_steps=sanity_steps, eval_at_start=t.eval_at_start,
        )
        if export_final is not None:
            if run.watchdog is not None:  # training is over and committed: a long export is no hang
                run.watchdog.stop()
            export_final(controller.global_step, {"metrics": metrics})
    return metrics


def _train_only(cfg: ExperimentConfig, progress: bool | None) -> dict[str, Any]:
    """Train without evaluating (a sidecar evaluates the checkpoints); FINAL marks the end."""
    if cfg.trainer.checkpoint_interval is None:
        logger.warning("trainer.checkpoint_interval is null: a sidecar will only see the final checkpoint")
    if cfg.trainer.eval_at_start:
        logger.warning("trainer.eval_at_start is ignored without in-process validation: the sidecar evaluates "
                       "checkpoints (cadence evaluate --initial evaluates the initialized model)")
    run = build_run(cfg, evaluate=False, progress=progress)
    with run, run.controller as controller:
        _save_config_if_training(cfg, run)
        controller.train(cfg.trainer.train_steps)
    return {}


def _save_config_if_training(cfg: ExperimentConfig, run: Run) -> None:
    """Write the resolved ``config.yaml`` into the model dir when the run will train, before its
    first checkpoint; a model dir restored at ``trainer.train_steps`` or past it (nothing to
    train) keeps the config it was trained with."""
    steps = cfg.trainer.train_steps
    if steps is None or run.controller.global_step < steps:  # a replica group's into its own directory
        save_config(cfg, layout.config_path(run.model_dir), workdir=os.getcwd())


def build_sidecar(cfg: ExperimentConfig) -> SidecarEvaluator:
    """A :class:`~cadence.sidecar.evaluator.SidecarEvaluator` for the experiment: the task's torch
    evaluator (with the ``evaluators:`` whose ``on`` holds ``sidecar``), the ``sidecar:`` settings,
    the configured eval actions (best checkpoint and its export, export on every evaluation) and
    callbacks (:func:`build_callbacks`). Early stopping needs the trainer's loop and is ignored here,
    with a warning."""
    model_dir = layout.check_model_dir(cfg.require_model_dir())
    t = cfg.trainer
    task, ctx, _, evaluator = build_runners_from_config(cfg, train=False)
    evaluator = with_external_evaluators(cfg, task, evaluator, "sidecar", layout.eval_dir(model_dir, cfg.sidecar.name))
    _, eval_actions = build_actions(cfg, task, evaluator.model, train=False, chief=ctx.is_chief, ema=evaluator.ema)
    callbacks = build_callbacks(cfg, task)
    export_on = cfg.export.on if cfg.export is not None else None
    callbacks += tracking_callbacks(cfg, ctx.is_chief, eval_name=layout.eval_dir(model_dir, cfg.sidecar.name).rsplit("/", 1)[-1],
                           export=export_on if export_on in ("best", "every_eval") else None)
    if t.early_stopping is not None:
        logger.warning("trainer.early_stopping is ignored by the sidecar: only an in-process evaluation can stop training")
    best = t.best_checkpoint
    return SidecarEvaluator(
        evaluator, model_dir, steps=t.validation_steps, eval_actions=eval_actions, train_steps=t.train_steps,
        best_metric=best.metric if best else None, higher_is_better=best.higher_is_better if best else True,
        callbacks=callbacks, coordinator=ctx.coordinator if ctx.world_size > 1 else None, **cfg.sidecar.model_dump(),
    )


def run_sidecar(cfg: ExperimentConfig) -> SidecarResult:
    """Run the experiment's sidecar evaluator until it stops (``cadence evaluate --continuous``,
    the evaluator role), in ``cfg.workdir`` when set; return what it did and why it stopped.
    ReaderLeaseHeldError, before anything is built, when another live sidecar or backfill of that
    name runs (:func:`~cadence.sidecar.evaluator.check_name_free`)."""
    with in_workdir(cfg) as cfg:
        check_name_free(layout.check_model_dir(cfg.require_model_dir()), cfg.sidecar.name)
        return build_sidecar(cfg).start()


def run_backfill(cfg: ExperimentConfig, checkpoints: Sequence[int] | None = None) -> SidecarResult:
    """Backfill the experiment's evaluation ``sidecar.name`` (``cadence evaluate --all`` /
    ``--steps``): evaluate the committed checkpoints (``checkpoints``: these steps; None: every one
    committed now) that have no record in its ``evaluations.jsonl`` yet, oldest first, with the
    sidecar's evaluator, eval actions and callbacks (:meth:`SidecarEvaluator.backfill
    <cadence.sidecar.evaluator.SidecarEvaluator.backfill>`), in ``cfg.workdir`` when set.

    Raises, before anything is built or written: ModelDirError (no such model dir),
    NoCheckpointError (a step neither committed nor recorded; nothing committed),
    ReaderLeaseHeldError (another live sidecar or backfill of that name).
    """
    with in_workdir(cfg) as cfg:
        model_dir = layout.check_model_dir(cfg.require_model_dir(), must_exist=True, writable=True)
        check_backfill(model_dir, cfg.sidecar.name, checkpoints)
        return build_sidecar(cfg).backfill(checkpoints)


def run_evaluation(cfg: ExperimentConfig, step: int | str | None = None, *,
                   initial: bool = False) -> tuple[int, dict[str, Any]]:
    """Evaluate a checkpoint; return ``(step, metrics)``.

    ``step``: a step number, ``"latest"`` or ``None`` (the newest committed in ``checkpoints/``), or
    ``"best"`` (the checkpoint in ``best/``: its step is returned). ``initial``: evaluate the
    initialized model instead (``build_model`` then ``Task.initialize``, as a fresh run starts; no
    checkpoint is read, ``step`` must be ``None``): step 0. With ``cfg.workdir``, it runs there
    (:func:`~cadence.config.workdir.in_workdir`).

    Raises:
      ModelDirError: the model dir is a file, or a file stands on its path.
      NoCheckpointError: the model dir has no committed checkpoint (or not that step, or no ``best/``
        for ``"best"``), before anything is built.
    """
    with in_workdir(cfg) as cfg:
        return _evaluate(cfg, step, initial)


def _evaluate(cfg: ExperimentConfig, step: int | str | None, initial: bool) -> tuple[int, dict[str, Any]]:
    model_dir = layout.check_model_dir(cfg.require_model_dir())  # a file, or a file on its path
    checkpoints = layout.checkpoints_dir(model_dir)
    none = NoCheckpointError(f"no committed checkpoint in {checkpoints}: nothing to evaluate "
                             "(--initial evaluates the initialized model)")
    restore_from = None
    if step == "latest":
        step = None
    if initial:
        if step is not None:
            raise ValueError("run_evaluation: initial=True evaluates no checkpoint; step must be None")
    elif step == "best":
        restore_from = layout.best_dir(model_dir)
        step = CheckpointManager(restore_from, writer=False).latest_step()
        if step is None:
            raise NoCheckpointError(_no_best(model_dir, "evaluate"))
    elif step is None and CheckpointManager(checkpoints, writer=False).latest_step() is None:
        raise none  # before anything is built: no "starting at step 0" line first
    if step is not None and not isinstance(step, int):
        raise ValueError(f"run_evaluation: step must be a step number, 'best' or 'latest', got {step!r}")
    run = build_run(cfg, train=False, restore_step=step, progress=False, restore=not initial,
                    restore_from=restore_from)
    with run.controller as controller:
        if initial:
            _initialize(run)
        elif controller.restored_step is None:  # deleted since
            raise none
        metrics = controller.evaluate(cfg.trainer.validation_steps)
        return controller.global_step, metrics


def _no_best(model_dir: str, command: str) -> str:
    """The message of a model dir without a best checkpoint, for ``--checkpoint best``."""
    return (f"no best checkpoint in {layout.best_dir(model_dir)} (set trainer.best_checkpoint, "
            f"or {command} --checkpoint latest)")


def _initialize(run: Run) -> None:
    """A fresh start's weights for an evaluation: ``task.init_from_pretrained``'s weights, then
    ``Task.initialize``, on the unwrapped model; with
    several ranks, rank 0's unsharded tensors broadcast (as the trainer's ``initialize``); the EMA
    reset to them."""
    module = unwrap_model(run.model)
    load = pretrained_loader(run.config.task.init_from_pretrained)
    if load is not None:
        load(module)
    run.task.initialize(module)
    if run.ctx.world_size > 1:
        broadcast_unsharded(module)
    if run.ema is not None:
        run.ema.reset()


def run_export(model_dir: str, formats: list[str], checkpoint: str | int = "best",
               out: str | None = None) -> tuple[int, str, dict[str, str]]:
    """Export a checkpoint of a model dir as inference artefacts; return ``(step, directory, files)``.

    The model is built from the model dir's resolved ``config.yaml``. ``checkpoint``: ``"best"``
    (``best/``), ``"latest"`` (the newest committed in ``checkpoints/``) or a step number (an int, or
    its digits).
    ``out``: the directory to write; default ``export/best/<step>/`` for the best checkpoint and
    ``export/checkpoint/<step>/`` otherwise. ``files``: ``{format: path}``; for a task with
    :meth:`Task.export_signatures`, ``{"<signature>/<format>": path}`` (one subdirectory of
    ``directory`` per signature, and ``signatures.json``). With ``trainer.ema`` in the model dir's
    config, the checkpoint's EMA weights are exported (the evaluated ones). The Task is built in the
    run's ``workdir`` (:func:`~cadence.config.workdir.in_workdir`). ``out`` must be absent,
    an empty directory, or a cadence export (then replaced): checked before anything is built, and
    again when the export is published (:mod:`cadence.export_marker`); nothing else is ever deleted.

    Raises:
      ModelDirError: ``model_dir`` is missing, a file, or not a model dir (no ``config.yaml``).
      NoCheckpointError: no such checkpoint (no ``best/``, no committed one, not that step).
      ExportTargetError: (a ConfigError) ``out`` is a file, a link, or a directory holding anything
        cadence did not write.
      ConfigError: a format that needs ``Task.example_inputs()`` the task does not define; a bad
        signature name, or a signature without the example inputs a format needs.
    """
    from cadence.config import load_config
    from cadence.errors import ModelDirError
    from cadence.export_marker import check_export_target
    from cadence.storage import Storage

    config_file = layout.config_path(model_dir)
    layout.check_model_dir(model_dir, must_exist=True)
    if not Storage(config_file).exists(Storage(config_file).root):
        raise ModelDirError(f"{config_file} not found: {model_dir} is not a cadence model dir (or was never trained)")
    if out is not None:  # before anything is built, read or created
        check_export_target(Storage(out), label="--out")
    cfg = load_config(config_file, model_dir=model_dir)
    if cfg.workdir is not None:  # the Task runs in the run's working directory: paths given from here first
        model_dir, out = absolute_local(model_dir), None if out is None else absolute_local(out)
    with in_workdir(cfg) as cfg:
        return _export(cfg, model_dir, formats, checkpoint, out)


def _export(cfg: ExperimentConfig, model_dir: str, formats: list[str], checkpoint: str | int,
            out: str | None) -> tuple[int, str, dict[str, str]]:
    from cadence.torch.export.api import export_task_model

    task, _, _, evaluator = build_runners_from_config(cfg, train=False, device="cpu", precision="32", compile_model=False)
    if checkpoint == "best":
        manager = CheckpointManager(layout.best_dir(model_dir), writer=False)
        if manager.latest_step() is None:
            raise NoCheckpointError(_no_best(model_dir, "export"))
        step = None
    else:
        manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False)
        step = None if checkpoint == "latest" else int(checkpoint)
    restored = manager.restore({"evaluator": evaluator}, step)
    if restored is None:
        raise NoCheckpointError(f"no committed checkpoint in {manager.directory}")
    example_inputs = example_inputs_for(task, formats, "--format", evaluator.model)
    directory = out or layout.export_dir(model_dir, "best" if checkpoint == "best" else "checkpoint", restored)
    with applied(evaluator.ema):  # the evaluated weights: the EMA's with trainer.ema
        files = export_task_model(task, evaluator.model, directory, formats, example_inputs=example_inputs,
                                  metadata={"step": restored, "source": manager.path(restored)})
    return restored, directory, files
