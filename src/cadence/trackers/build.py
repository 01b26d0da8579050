"""The trackers of an experiment config's ``loggers:`` section, and the callback that feeds them."""

from __future__ import annotations

from typing import Any

from cadence import layout
from cadence.config.schema import ExperimentConfig
from cadence.trackers.base import Tracker
from cadence.trackers.callback import TrackerCallback

__all__ = ["build_trackers", "tracker_callback"]


def build_trackers(cfg: ExperimentConfig) -> list[Tracker]:
    """One tracker per section of ``cfg.loggers`` that is set (none by default).

    Raises:
      ConfigError: a tracker's package is not installed (naming its extra, ``cadence[mlflow]``).
    """
    loggers = cfg.loggers
    model_dir = cfg.model_dir
    trackers: list[Tracker] = []
    if loggers.mlflow is not None:
        from cadence.trackers.mlflow_tracker import MLflowTracker

        m = loggers.mlflow
        trackers.append(MLflowTracker(m.tracking_uri, m.experiment, m.run_name, m.tags, model_dir=model_dir))
    if loggers.wandb is not None:
        from cadence.trackers.wandb_tracker import WandbTracker

        w = loggers.wandb
        trackers.append(WandbTracker(w.project, w.entity, w.mode, w.dir, w.run_name, w.tags, model_dir=model_dir))
    return trackers


def tracker_callback(cfg: ExperimentConfig, *, chief: bool = True, eval_name: str | None = None,
                     export: str | None = None, storage_options: dict[str, Any] | None = None
                     ) -> TrackerCallback | None:
    """The :class:`TrackerCallback` of the config's ``loggers:`` (None when none is set).

    ``chief``: False builds no tracker (other ranks log nothing), after checking that the
    packages are there, as on the chief. ``eval_name``: the evaluation's directory name, the
    prefix of its metrics (``eval``, ``eval_<name>`` for a named sidecar). ``export``: the export
    name (``final``, ``best``, ``every_eval``) whose newest export this process logs as an
    artifact when it closes; None: none.
    """
    trackers = build_trackers(cfg)
    if not trackers:
        return None
    model_dir = cfg.require_model_dir()
    return TrackerCallback(
        trackers if chief else [], model_dir=model_dir, params=cfg.to_dict(),
        eval_prefix=eval_name or layout.EVAL, export_dir=layout.export_dir(model_dir, export) if export else None,
        storage_options=storage_options,
    )
