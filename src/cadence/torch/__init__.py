"""cadence for PyTorch: the Task a user writes, and the trainer / evaluator that run it.

Everything in cadence that imports torch lives in this package. The names below are its public
API; the low-level state helpers (RNG states, safetensors and ``torch.save`` files) are not: they
live in :mod:`cadence.torch.runtime.rng` and :mod:`cadence.torch.checkpoint_io.state`.
"""

from cadence._lazy import lazy_attributes
from cadence.torch.data.batch import first_tensor, move_to_device
from cadence.torch.runtime.context import Context
from cadence.torch.data.loaders import ResumableLoader, ResumableSampler
from cadence.torch.runtime.distributed import TorchCoordinator, init_distributed, rank_env, shutdown_distributed
from cadence.torch.loop.evaluator import TorchEvaluator
from cadence.torch.export.api import ExportModel, export_model, load_exported
from cadence.torch.export.formats import FORMATS
from cadence.torch.task.export_specs import ExportSpec
from cadence.torch.components.metrics import TorchMetricsReducer
from cadence.torch.components.precision import Precision, resolve_precision
from cadence.torch.export.signatures import export_model_signatures, read_signatures
from cadence.torch.task.export_specs import ExportSignature
from cadence.torch.task.task import Task
from cadence.torch.task.lr_schedule import LRSchedule, TrainingPlan
from cadence.torch.loop.trainer import TorchTrainer
from cadence.torch.experiments.runners import build_runners

_EXPERIMENT = ("build_sidecar", "run_backfill", "run_evaluation", "run_sidecar", "run_training")
_RUN = ("Run", "build_run")
_TASK_LOADER = ("build_task", "load_task_class")
_SMOKE = ("SmokeReport", "StageResult", "run_smoke")

# The config-driven entry points, imported on first use.
__getattr__ = lazy_attributes(
    __name__,
    {**dict.fromkeys(_EXPERIMENT, "cadence.torch.experiments.experiment"),
     **dict.fromkeys(_RUN, "cadence.torch.experiments.run"),
     **dict.fromkeys(_TASK_LOADER, "cadence.torch.experiments.task_loader"),
     **dict.fromkeys(_SMOKE, "cadence.torch.experiments.smoke"),
     "train_and_evaluate": "cadence.torch.experiments.roles"},
    (),
)[0]


__all__ = [
    "Context",
    "ExportModel",
    "ExportSignature",
    "ExportSpec",
    "FORMATS",
    "LRSchedule",
    "Precision",
    "ResumableLoader",
    "ResumableSampler",
    "Task",
    "TorchCoordinator",
    "TorchEvaluator",
    "TorchMetricsReducer",
    "TorchTrainer",
    "TrainingPlan",
    "build_runners",
    "export_model",
    "export_model_signatures",
    "first_tensor",
    "init_distributed",
    "load_exported",
    "read_signatures",
    "move_to_device",
    "rank_env",
    "resolve_precision",
    "shutdown_distributed",
    "train_and_evaluate",
    *_EXPERIMENT,
    *_RUN,
    *_TASK_LOADER,
    *_SMOKE,
]
