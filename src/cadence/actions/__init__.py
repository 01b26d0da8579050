"""Framework-agnostic actions: callables the Controller runs on each train loop's or evaluation's
output (no torch here).

The action contract: ``action(output: dict) -> Any``; raising :class:`~cadence.errors.StopTraining`
ends training cleanly. What else an action may be and use is declared in :mod:`cadence.extensions`:
``RunAware`` (``attach(run)``: handed the run's :class:`~cadence.extensions.RunContext` once),
``Stateful`` (saved in and restored from checkpoints), ``Closeable``, ``Composite`` (a wrapper).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import lazy_attributes
from cadence.actions.best_metric import NewBestMetric
from cadence.actions.conditional import Condition, ConditionalAction
from cadence.actions.early_stopping import EarlyStopping
from cadence.actions.export_files import ExportFileManager
from cadence.actions.metric_path import Metric, MetricFn, MetricNotFoundError, get_metric
from cadence.actions.periodic import PeriodicAction
from cadence.actions.persisted import JSONPersistedValue, PersistedValueError

# Actions in modules of their own that import more of cadence (checkpoints, signals): loaded on
# first use, so that importing the basic actions stays light and independent of them.
_LAZY = {
    "BestCheckpointExporter": "cadence.actions.best_checkpoint",
    "RecoveryAction": "cadence.actions.recovery",
    "SaveCheckpointIfPreempted": "cadence.actions.preemption",
}

__all__ = [
    "BestCheckpointExporter",
    "Condition",
    "ConditionalAction",
    "EarlyStopping",
    "ExportFileManager",
    "JSONPersistedValue",
    "Metric",
    "MetricFn",
    "MetricNotFoundError",
    "NewBestMetric",
    "PeriodicAction",
    "PersistedValueError",
    "RecoveryAction",
    "SaveCheckpointIfPreempted",
    "get_metric",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)


if TYPE_CHECKING:  # pragma: no cover
    from cadence.actions.best_checkpoint import BestCheckpointExporter
    from cadence.actions.preemption import SaveCheckpointIfPreempted
    from cadence.actions.recovery import RecoveryAction
