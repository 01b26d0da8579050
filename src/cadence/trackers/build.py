"""The trackers of an experiment config's ``loggers:`` section (:func:`build_trackers`)."""

from __future__ import annotations

from typing import Any

from cadence import layout
from cadence.config.schema import ExperimentConfig
from cadence.trackers.base import Tracker

__all__ = ["build_trackers"]


def build_trackers(cfg: ExperimentConfig, *, chief: bool = True, eval_name: str | None = None,
                   export: str | None = None, storage_options: dict[str, Any] | None = None) -> list[Tracker]:
    """One tracker per section of ``cfg.loggers`` that is set (none by default), each a
    :class:`~cadence.Callback` for the run's controller, logging into the model dir's run.

    ``chief``: False returns none (other ranks log nothing), after checking that the packages
    are there, as on the chief. ``eval_name``: the evaluation's directory name, the prefix of its
    metrics (``eval``, ``eval_<name>`` for a named sidecar). ``export``: the export name
    (``final``, ``best``, ``every_eval``) whose newest export this process logs as an artifact
    when it closes; None: none.

    Raises:
      ConfigError: a tracker's package is not installed (naming its extra, ``cadence[mlflow]``).
    """
    loggers = cfg.loggers
    if loggers.mlflow is None and loggers.wandb is None:
        return []
    model_dir = cfg.require_model_dir()
    run: dict[str, Any] = {
        "model_dir": model_dir, "params": cfg.to_dict(), "eval_prefix": eval_name or layout.EVAL,
        "export_dir": layout.export_dir(model_dir, export) if export else None, "storage_options": storage_options,
    }
    trackers: list[Tracker] = []
    if loggers.mlflow is not None:
        from cadence.trackers.mlflow_tracker import MLflowTracker

        m = loggers.mlflow
        trackers.append(MLflowTracker(m.tracking_uri, m.experiment, m.run_name, m.tags,
                                      artifact_location=m.artifact_location, **run))
    if loggers.wandb is not None:
        from cadence.trackers.wandb_tracker import WandbTracker

        w = loggers.wandb
        trackers.append(WandbTracker(w.project, w.entity, w.mode, w.dir, w.run_name, w.tags, **run))
    return trackers if chief else []
