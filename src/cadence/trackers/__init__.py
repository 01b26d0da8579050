"""Experiment trackers: MLflow, Weights & Biases, or your own :class:`Tracker`, each a
:class:`~cadence.Callback` fed by the run's events (framework-agnostic: no torch).

From a config: the ``loggers:`` section (:func:`build_trackers`); from Python::

    from cadence.trackers import MLflowTracker
    tracker = MLflowTracker(tracking_uri="sqlite:///mlflow.db", model_dir="runs/x", params=cfg.to_dict())
    Controller(..., callbacks=[tracker])

The tracker packages are optional extras (``pip install 'cadence[mlflow]'``,
``'cadence[wandb]'``), imported only when a tracker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import lazy_attributes

_EXPORTS = {
    "Tracker": "cadence.trackers.base",
    "flatten_params": "cadence.trackers.base",
    "MLflowTracker": "cadence.trackers.mlflow_tracker",
    "WandbTracker": "cadence.trackers.wandb_tracker",
    "build_trackers": "cadence.trackers.build",
}

__all__ = [*_EXPORTS]

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, __all__)

if TYPE_CHECKING:  # pragma: no cover
    from cadence.trackers.base import Tracker, flatten_params
    from cadence.trackers.build import build_trackers
    from cadence.trackers.mlflow_tracker import MLflowTracker
    from cadence.trackers.wandb_tracker import WandbTracker
