"""cadence: the life cycle of PyTorch training.

Train in loops of N steps, evaluate on a schedule, checkpoint atomically and resume exactly,
react to results with actions. The names below are the public API; they are imported lazily so
that ``import cadence`` stays fast and never imports torch. What needs torch -- the Task, the
torch trainer and evaluator, ``train_and_evaluate`` for a config -- is in ``cadence.torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import lazy_attributes

__version__ = "0.1.0"

_EXPORTS = {
    "Controller": "cadence.loop.controller",
    # what a user implements (cadence.extensions lists them all)
    **dict.fromkeys(
        ("Action", "Callback", "ChecksOutputs", "Closeable", "Composite", "EndsTraining", "Evaluator", "GathersCheckpoint",
         "Initializable", "NamedInCheckpoint", "PlansSteps", "ReportsSteps", "RunAware", "RunContext", "Stateful", "Trainer"),
        "cadence.extensions"),
    "Tracker": "cadence.trackers.base",
    "CheckpointManager": "cadence.checkpoint",
    "SummaryWriter": "cadence.summaries.writer",
    "ProgressReporter": "cadence.summaries.progress",
    "ExperimentConfig": "cadence.config",
    "load_config": "cadence.config",
    "CadenceError": "cadence.errors",
    "StopTraining": "cadence.errors",
    "ConfigError": "cadence.errors",
    "CheckpointError": "cadence.errors",
    "CorruptCheckpointError": "cadence.errors",
    "UnsafeCheckpointError": "cadence.errors",
    "TrainingDivergedError": "cadence.errors",
    "PreemptedExit": "cadence.errors",
    "CheckpointSpaceError": "cadence.errors",
    "WriterLeaseHeldError": "cadence.errors",
    "WriterLeaseLostError": "cadence.errors",
    "SanityCheckError": "cadence.errors",
    "ConditionalAction": "cadence.actions",
    "PeriodicAction": "cadence.actions",
    "JSONPersistedValue": "cadence.actions",
    "NewBestMetric": "cadence.actions",
    "ExportFileManager": "cadence.actions",
    "EarlyStopping": "cadence.actions",
    "RecoveryAction": "cadence.actions",
    "SaveCheckpointIfPreempted": "cadence.actions",
    "BestCheckpointExporter": "cadence.actions",
    "SidecarEvaluator": "cadence.sidecar.evaluator",
    "resolve_role": "cadence.cluster.roles",
    "build_report": "cadence.reports.run_report",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, __all__)


if TYPE_CHECKING:  # pragma: no cover
    from cadence.actions import (
        BestCheckpointExporter,
        ConditionalAction,
        EarlyStopping,
        ExportFileManager,
        JSONPersistedValue,
        NewBestMetric,
        PeriodicAction,
        RecoveryAction,
        SaveCheckpointIfPreempted,
    )
    from cadence.checkpoint import CheckpointManager
    from cadence.extensions import (
        Action,
        Callback,
        ChecksOutputs,
        Closeable,
        Composite,
        EndsTraining,
        Evaluator,
        GathersCheckpoint,
        Initializable,
        NamedInCheckpoint,
        PlansSteps,
        ReportsSteps,
        RunAware,
        RunContext,
        Stateful,
        Trainer,
    )
    from cadence.cluster.roles import resolve_role
    from cadence.config import ExperimentConfig, load_config
    from cadence.loop.controller import Controller
    from cadence.errors import (
        CadenceError,
        CheckpointError,
        CheckpointSpaceError,
        ConfigError,
        CorruptCheckpointError,
        PreemptedExit,
        SanityCheckError,
        StopTraining,
        TrainingDivergedError,
        UnsafeCheckpointError,
        WriterLeaseHeldError,
        WriterLeaseLostError,
    )
    from cadence.summaries.progress import ProgressReporter
    from cadence.reports.run_report import build_report
    from cadence.sidecar.evaluator import SidecarEvaluator
    from cadence.summaries.writer import SummaryWriter
    from cadence.trackers.base import Tracker
