"""The actions of a run built from a config: what runs after each training loop and after each
evaluation (:func:`build_actions`)."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from cadence import layout
from cadence.cluster import slurm
from cadence.config import ExperimentConfig
from cadence.torch.components.ema import ModelEMA
from cadence.torch.experiments.exporting import ExportEveryEval, ModelExporter
from cadence.torch.task.task import Task

__all__ = ["build_actions"]

logger = logging.getLogger("cadence")


def build_actions(cfg: ExperimentConfig, task: Task, model: Any, *, train: bool,
                  evaluate: bool = True, chief: bool = True, ema: ModelEMA | None = None) -> tuple[list, list]:
    """``(train_actions, eval_actions)`` from the config's ``trainer`` and ``export`` sections
    (``ema``: the exports are of its weights).

    Train actions (``train``): NaN/loss-spike recovery, a sweep trial's stop once pruned, then
    saving on preemption (last, so a preemption save sees the state after a recovery). Eval actions
    (``evaluate``): best-checkpoint export (and its inference export), exporting after every
    evaluation, early stopping (only with ``train``: a sidecar cannot stop the trainer), then a
    sweep trial's report to its Optuna trial (``sweep_trial``; the trainer's stops it when pruned).
    """
    from cadence.actions import BestCheckpointExporter, EarlyStopping, RecoveryAction, SaveCheckpointIfPreempted

    t = cfg.trainer
    train_actions: list[Any] = []
    eval_actions: list[Any] = []
    export_on = cfg.export.on if cfg.export is not None else None
    if train and t.recovery is not None:
        r = t.recovery
        train_actions.append(RecoveryAction(r.loss_upper_bound, r.recovery_begin_steps, r.max_trials))
    if train and cfg.sweep_trial is not None:  # a sidecar's (or an earlier run's) prune decision stops the trainer
        from cadence.sweep.pruning import StopWhenPruned

        train_actions.append(StopWhenPruned(cfg.require_model_dir()))
    if train and t.save_on_preemption:
        train_actions.append(SaveCheckpointIfPreempted(requeue=_requeue(cfg, chief), final_step=t.train_steps))
    if not evaluate:
        return train_actions, eval_actions
    if t.best_checkpoint is not None:
        b = t.best_checkpoint
        export_fn = ModelExporter(cfg, task, model, "best", chief=chief, ema=ema) if export_on == "best" else None
        eval_actions.append(BestCheckpointExporter(layout.best_dir(cfg.require_model_dir()), b.metric, b.higher_is_better,
                                                   export_fn=export_fn))
    if export_on == "every_eval":
        eval_actions.append(ExportEveryEval(ModelExporter(cfg, task, model, "every_eval", chief=chief, ema=ema)))
    if train and t.early_stopping is not None:
        e = t.early_stopping
        eval_actions.append(EarlyStopping(e.metric, e.patience, e.min_delta, e.higher_is_better))
    if cfg.sweep_trial is not None:
        from cadence.sweep.pruning import ReportToTrial

        eval_actions.append(ReportToTrial.from_config(cfg.sweep_trial, cfg.require_model_dir(), stops=train))
    return train_actions, eval_actions


def _requeue(cfg: ExperimentConfig, chief: bool) -> Callable[[], str | None] | None:
    """``trainer.slurm.requeue`` in a Slurm job: ``scontrol requeue`` of this job. Outside one, None
    and (on the chief) a warning: the same config also runs outside Slurm, where a preemption saves
    and exits as always."""
    if not cfg.trainer.slurm.requeue:
        return None
    job = slurm.job_id()
    if job is None:
        if chief:
            logger.warning("trainer.slurm.requeue: not in a Slurm job (SLURM_JOB_ID is not set); a preemption "
                           "saves and exits without a requeue")
        return None
    return functools.partial(slurm.requeue_job, job)
