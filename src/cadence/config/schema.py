"""The experiment config's schema: one pydantic model per section, each field with its default,
bounds and meaning -- the one place they are written. ``docs/config.md`` is generated from it, and
every "expected ..." in an error message is derived from it (:mod:`cadence.config.errors`): a
field whose accepted values need other words than its type says declares them as
``json_schema_extra={"expected": ...}``.

This module assembles the sections: a component's settings are its own model, in
:mod:`cadence.config.components` (EMA, profiler, compile, LR schedule), read by the component and by
the schema alike; ``trainer:`` is :mod:`cadence.config.trainer`; the rest is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, PrivateAttr, StrictBool, field_validator, model_validator

from cadence import layout
from cadence.actions.export_files import DEFAULT_MAX_EXPORTS
from cadence.checkpoint.checksum import DEFAULT_ALGORITHM, Algorithm
from cadence.checkpoint.leases import DEFAULT_LEASE_TTL
from cadence.checkpoint.writer_lease import DEFAULT_WRITER_LEASE_TTL
from cadence.config.base import MAX_SECONDS, ConfigModel
from cadence.config.class_paths import CLASS_SPEC_FORM, check_class_spec, resolve_class_path
from cadence.config.components.activation_checkpoint import ActivationCheckpointConfig
from cadence.config.components.compile import CompileConfig
from cadence.config.components.ema import EMAConfig
from cadence.config.components.external_evaluators import ExternalEvaluatorConfig, ExternalEvaluatorsConfig
from cadence.config.components.lr_schedule import LRScheduleConfig
from cadence.config.components.profiler import ProfilerConfig
from cadence.config.trainer import (
    BestCheckpointConfig,
    EarlyStoppingConfig,
    Precision,
    RecoveryConfig,
    Strategy,
    TrainerConfig,
)

__all__ = [
    "EXPORT_FORMATS",
    "MOVED_KEYS",
    "ActivationCheckpointConfig",
    "BestCheckpointConfig",
    "CallbackConfig",
    "CheckpointConfig",
    "ClassSpec",
    "CompileConfig",
    "EMAConfig",
    "EarlyStoppingConfig",
    "EvalSpecConfig",
    "ExperimentConfig",
    "ExportConfig",
    "ExportFormat",
    "ExternalEvaluatorConfig",
    "LRScheduleConfig",
    "LoggersConfig",
    "MLflowConfig",
    "Precision",
    "ProfilerConfig",
    "PrunerConfig",
    "Strategy",
    "RecoveryConfig",
    "SidecarConfig",
    "SweepTrialConfig",
    "TaskConfig",
    "TrainerConfig",
    "WandbConfig",
    "resolve_task_class",
]

ExportFormat = Literal["safetensors", "torch_export", "torchscript", "onnx", "hf"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
"""Every inference format, in the order the docs list them (the CLI's choices, the exporters')."""
_FORMAT_NOTES = {"torch_export": " (.pt2)", "onnx": " (needs `cadence[onnx]`)",
                 "hf": " (a transformers model's `save_pretrained` directory; needs `cadence[hf]`)"}

MOVED_KEYS: dict[tuple[str, ...], str] = {
    ("trainer", "async_checkpoint"): "checkpoint.async_save",
    ("trainer", "throttle_secs"): "eval_spec.throttle_secs",
    ("trainer", "start_delay_secs"): "eval_spec.start_delay_secs",
}
"""Keys of earlier versions and where they live now: an error names the new key."""


class ClassSpec(ConfigModel):
    """A class to build and its keyword arguments (the task, each callback)."""

    class_path: str = Field(
        alias="class",
        description=(
            "The class, as `module:ClassName` (imported from `sys.path`) or `path/to/file.py:ClassName` "
            "(a relative path is resolved against the config file's directory)."
        ),
        json_schema_extra={"expected": f"a string {CLASS_SPEC_FORM}"},
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the class. Free-form: not validated here.",
        json_schema_extra={"expected": "a mapping of keyword arguments"},
    )

    @field_validator("class_path")
    @classmethod
    def _check_class_path(cls, value: str) -> str:
        return check_class_spec(value)


class TaskConfig(ClassSpec):
    """The Task class (a `cadence.torch.Task`), its keyword arguments, and the weights it starts from."""

    init_from_pretrained: str | None = Field(
        default=None,
        description=(
            "A local `save_pretrained` directory (an `hf` export, a downloaded model) whose weights a fresh "
            "start loads before `Task.initialize`; ignored when a checkpoint is restored. Relative to the "
            "current directory (the run's `workdir`, when set)."
        ),
        json_schema_extra={"expected": "a directory path"},
    )


CallbackConfig = ClassSpec
"""``callbacks[i]``: a ``cadence.Callback`` class and its keyword arguments."""


class ExportConfig(ConfigModel):
    """Inference artefacts written under `MODEL_DIR/export/<on>/<step>/`."""

    formats: list[ExportFormat] = Field(
        default_factory=lambda: list[ExportFormat](["safetensors"]),
        description="Artefacts per export: " + ", ".join(f"`{f}`{_FORMAT_NOTES.get(f, '')}" for f in EXPORT_FORMATS) + ".",
    )
    on: Literal["best", "final", "every_eval"] = Field(
        default="best",
        description=("When to export: on a new best checkpoint (needs `trainer.best_checkpoint`), at the end of "
                     "training, or after every evaluation."),
    )
    max_to_keep: int | None = Field(
        default=DEFAULT_MAX_EXPORTS, ge=0, strict=True, description="Newest exports kept; `null` keeps all."
    )


class SidecarConfig(ConfigModel):
    """The sidecar evaluator (`cadence evaluate --continuous`, `cadence launch --sidecar`)."""

    mode: Literal["every", "latest"] = Field(
        default="every", description="`every`: each committed checkpoint in step order; `latest`: jump to the newest."
    )
    timeout: float | None = Field(
        default=3600.0, ge=0, le=MAX_SECONDS,
        description="Stop after this many seconds without a new checkpoint (a dead trainer); `null`: wait for `FINAL`.",
    )
    poll_interval: float = Field(default=0.5, gt=0, le=MAX_SECONDS,
                                 description="Seconds between looks for new checkpoints.")
    max_pending: int | None = Field(
        default=8, ge=1, strict=True,
        description="Unevaluated checkpoints protected from the trainer's retention; the oldest beyond it are skipped.",
    )
    max_evaluations: int | None = Field(
        default=None, ge=1, strict=True, description="Stop after this many evaluations in total; `null`: no limit."
    )
    lease_ttl: float = Field(
        default=DEFAULT_LEASE_TTL, gt=0, le=MAX_SECONDS,
        description="Seconds a lease lives without renewal (a killed sidecar's lease ends then).",
    )
    name: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$", max_length=64,
        json_schema_extra={"expected": "a name of letters, digits, '_', '-' and '.' (not first; at most 64 characters)"},
        description="Write to `eval_<name>/` instead of `eval/` (several sidecars on one model dir).",
    )
    max_retries: int = Field(
        default=3, ge=0, le=30, strict=True,
        description="A committed checkpoint that fails to load is retried this many times, then recorded as failed.",
    )
    retry_backoff: float = Field(
        default=0.5, gt=0, le=MAX_SECONDS, description="Seconds before the first retry; each further retry waits twice as long.",
    )


class CheckpointConfig(ConfigModel):
    """How checkpoints are written (the CheckpointManager's own settings; what is kept is `trainer:`'s)."""

    async_save: StrictBool | Literal["auto"] = Field(
        default="auto",
        json_schema_extra={"expected": "true, false or 'auto'"},
        description=(
            "`true`: copy the state to CPU memory at a save and commit it from a background thread (one save "
            "in flight); the copy is reused by the next save, so one extra CPU copy of the state stays "
            "resident. `auto`: asynchronous only once the last two saves' write and commit each took longer "
            "than 20 ms (the first save: a state of 16 MiB or more), as a small state is saved sooner "
            "synchronously."
        ),
    )
    pipelined: StrictBool = Field(
        default=True,
        description=("With asynchronous saves, copy the parameters, optimizer state and EMA beside the next "
                     "step's forward and backward passes (the buffers, RNG and data position at the save); the "
                     "next optimizer step waits for what is left of the copy. The checkpoint is the synchronous "
                     "one, bit for bit. `false`: copy everything at the save (needed only by a `train_step` that "
                     "changes parameters in place outside the optimizer)."),
    )
    writer_lease_ttl: float = Field(
        default=DEFAULT_WRITER_LEASE_TTL, gt=0, le=MAX_SECONDS, allow_inf_nan=False,
        description=("Seconds the trainer's writer lease on the model dir lives without renewal (renewed every "
                     "quarter of it): a trainer that dies on another host frees the model dir this long after; "
                     "keep it well above the hosts' clock skew."),
    )
    checksum: Algorithm = Field(
        default=DEFAULT_ALGORITHM,
        description=("The checksum each manifest records for every file, computed as the file is written and "
                     "checked before any byte is used: crc32c (the checksum S3 and GCS compute natively) or "
                     "xxh3_128, both at memory speed, or sha256 (cryptographic, ~8x slower). Checkpoints "
                     "keep verifying with the algorithm they were written with."),
    )

    @field_validator("async_save", mode="before")
    @classmethod
    def _true_false_or_auto(cls, value: object) -> object:
        if value is True or value is False or value == "auto":
            return value
        raise ValueError("expected true, false or 'auto'")  # one message, not one per member of the union


class EvalSpecConfig(ConfigModel):
    """tf.estimator's `EvalSpec` throttling of the in-process evaluations of `cadence train`."""

    throttle_secs: float = Field(
        default=0.0, ge=0, le=MAX_SECONDS,
        description=("Skip an in-process evaluation due sooner than this after the previous one started "
                     "(never the final)."),
    )
    start_delay_secs: float = Field(
        default=0.0, ge=0, le=MAX_SECONDS,
        description="Skip in-process evaluations due in the first this many seconds (never the final).",
    )


class MLflowConfig(ConfigModel):
    """Log the run into MLflow (`pip install 'cadence[mlflow]'`): one run per model dir."""

    tracking_uri: str | None = Field(
        default=None,
        description=("The tracking store: a server (`http://host:5000`), `sqlite:///path/mlflow.db`, ... `null`: the "
                     "one the model dir's run was started with, else MLflow's default (`$MLFLOW_TRACKING_URI`, else "
                     "`sqlite:///mlflow.db` in the current directory)."),
    )
    experiment: str = Field(default="cadence", min_length=1, description="The experiment's name (created when missing).")
    run_name: str | None = Field(default=None, description="The run's name; `null`: the model dir's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on a new run.")
    artifact_location: str | None = Field(
        default=None,
        description=("Where the experiment, when cadence creates it, keeps its runs' artifacts (MLflow's "
                     "`artifact_location`, a path or URI; each run's go to `<location>/<run_id>/artifacts`); an "
                     "existing experiment keeps its own. `null`: `MODEL_DIR/trackers/mlflow` of the model dir that "
                     "creates it (a local model dir and tracking store), else the tracking server's or MLflow's "
                     "default (which for a local store is `./mlruns` in the current directory)."),
    )


class WandbConfig(ConfigModel):
    """Log the run into Weights & Biases (`pip install 'cadence[wandb]'`): one run per model dir."""

    project: str = Field(default="cadence", min_length=1, description="The W&B project.")
    entity: str | None = Field(default=None, description="The W&B entity (user or team); `null`: your default.")
    mode: Literal["offline", "online", "disabled"] = Field(
        default="offline",
        description=("`offline` needs no network or account (upload later with `wandb sync`); `online` logs live "
                     "(after `wandb login`); `disabled` logs nothing."),
    )
    dir: str | None = Field(
        default=None,
        description=("Where W&B writes its files (`<dir>/wandb/`); `null`: `MODEL_DIR/trackers` for a local model "
                     "dir, else the current directory."),
    )
    run_name: str | None = Field(default=None, description="The run's display name; `null`: the model dir's name.")
    tags: list[str] = Field(default_factory=list, description="Tags of the run.")


class LoggersConfig(ConfigModel):
    """Experiment trackers the chief (and each sidecar) logs the run into, besides TensorBoard and
    `metrics.jsonl` (always written). Each is off unless its section is given (`mlflow: {}` turns
    MLflow on with its defaults)."""

    mlflow: MLflowConfig | None = Field(default=None, description="MLflow; `null`: off.")
    wandb: WandbConfig | None = Field(default=None, description="Weights & Biases; `null`: off.")


PrunerKind = Literal["median", "successive_halving", "hyperband", "none"]
_PRUNER_FIELDS: dict[str, tuple[str, ...]] = {
    "median": ("n_startup_trials", "n_warmup_steps", "interval_steps", "n_min_trials"),
    "successive_halving": ("min_resource", "reduction_factor", "min_early_stopping_rate", "bootstrap_count"),
    "hyperband": ("min_resource", "max_resource", "reduction_factor", "bootstrap_count"),
    "none": (),
}
"""The settings each pruner kind takes (``cadence.sweep`` builds Optuna's pruner from them)."""


class PrunerConfig(ConfigModel):
    """Optuna's pruner of a sweep: after each evaluation of a trial it compares the trial's value at that global
    step with the other trials' and may stop it (`cadence sweep`; the space file's `pruner:`). Steps are global
    training steps. A setting only other kinds take is an error (but at its default); one left out is Optuna's default."""

    kind: PrunerKind = Field(
        default="median",
        description=("`median` (stop a trial worse than the median of the completed trials at the same step), "
                     "`successive_halving` (ASHA's rungs), `hyperband` (several successive-halving brackets) "
                     "or `none` (no pruning)."),
    )
    n_startup_trials: int = Field(
        default=5, ge=0, strict=True, description="median: no pruning until this many trials have completed.")
    n_warmup_steps: int = Field(
        default=0, ge=0, strict=True, description="median: no pruning of a trial before this global step.")
    interval_steps: int = Field(
        default=1, ge=1, strict=True, description="median: prune only at steps this many steps after the warmup.")
    n_min_trials: int = Field(
        default=1, ge=1, strict=True, description="median: trials reported at a step needed before pruning at it.")
    min_resource: int | None = Field(
        default=None, ge=1, strict=True,
        description=("successive_halving, hyperband: the global step of the first rung; `null`: Optuna's default "
                     "(successive halving: estimated from the first completed trial; hyperband: 1)."),
    )
    max_resource: int | None = Field(
        default=None, ge=1, strict=True,
        description="hyperband: the global step a trial trains to (`trainer.train_steps`); `null`: estimated.",
    )
    reduction_factor: int | None = Field(
        default=None, ge=2, strict=True,
        description="successive_halving, hyperband: 1 in this many trials goes on at each rung; `null`: 4 / 3.",
    )
    min_early_stopping_rate: int = Field(
        default=0, ge=0, strict=True, description="successive_halving: the first rung is at min_resource * factor**rate.")
    bootstrap_count: int = Field(
        default=0, ge=0, strict=True,
        description=("successive_halving, hyperband: a trial goes on past a rung only once more than this many "
                     "trials reached it (until then it is pruned there); `0`: no such wait."),
    )

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> PrunerConfig:
        # (a setting at its default is no choice: a saved config.yaml holds every one)
        foreign = sorted(name for name in self.model_fields_set - {"kind"} - set(_PRUNER_FIELDS[self.kind])
                         if getattr(self, name) != type(self).model_fields[name].default)
        if foreign:
            raise ValueError(f"the {self.kind} pruner takes {', '.join(_PRUNER_FIELDS[self.kind]) or 'no settings'}, "
                             f"not {', '.join(foreign)}")
        return self


class SweepTrialConfig(ConfigModel):
    """Written by `cadence sweep` into each trial's `config.yaml`: the Optuna trial this run is. Each evaluation
    (in-process, or the sidecar's) reports `metric` at its global step to the trial; when the pruner says so the
    run stops cleanly (final checkpoint, `FINAL` with the reason) and `MODEL_DIR/pruned.json` records why. A
    resumed trial reports to the same Optuna trial (a step reported before keeps its first value)."""

    storage: str = Field(
        min_length=1, description="The study's storage: an SQLAlchemy URL (`sqlite:////abs/SWEEP_DIR/study.db`).")
    study_name: str = Field(min_length=1, description="The study's name in the storage.")
    trial_number: int = Field(ge=0, strict=True, description="The trial's number in the study (`trial-<n>/`).")
    metric: str = Field(min_length=1, description="The eval metric reported (a key, or `a/b` for a nested one).")
    direction: Literal["maximize", "minimize"] = Field(description="Whether larger or smaller values are better.")
    pruner: PrunerConfig = Field(default_factory=PrunerConfig, description="The study's pruner.")


class ExperimentConfig(ConfigModel):
    """A whole experiment: where it writes, what it trains, and how."""

    model_dir: str | None = Field(
        default=None, json_schema_extra={"expected": "a path or URL (a string)"},
        description=("The model directory (checkpoints, summaries, exports): a local path or an fsspec URL. The "
                     "CLI's `--model-dir` overrides it."),
    )
    workdir: str | None = Field(
        default=None, json_schema_extra={"expected": "a directory path (a string)"},
        description=("The directory the run's relative paths are relative to: `cadence train` records the one it ran "
                     "in, into `MODEL_DIR/config.yaml` (relative to that file when the model dir lies inside it). "
                     "`cadence export`, `evaluate` and the sidecar given that config build and run the Task there, "
                     "so `task.params` paths and `task.init_from_pretrained` work from any directory. `null`: the "
                     "current directory."),
    )
    task: TaskConfig = Field(description="The Task (a subclass of `cadence.torch.Task`): what model, data and loss to train.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The training loop's schedule and numerics.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="How checkpoints are written.")
    eval_spec: EvalSpecConfig = Field(
        default_factory=EvalSpecConfig, description="tf.estimator's throttling of in-process evaluations."
    )
    sidecar: SidecarConfig = Field(default_factory=SidecarConfig, description="The sidecar evaluator's settings.")
    evaluators: ExternalEvaluatorsConfig = Field(
        default_factory=list, description="External evaluator commands (lm-eval, ...) run on each evaluated checkpoint.")
    export: ExportConfig | None = Field(
        default=None, description="Export inference artefacts; `null`: no exports during training."
    )
    callbacks: list[CallbackConfig] = Field(
        default_factory=list,
        description=("Callbacks (`cadence.Callback`) called at the run's events: training start and end, checkpoint "
                     "saved or loaded, evaluation done, close. Built after the Task's own (`Task.build_callbacks()`), "
                     "which come first."),
    )
    loggers: LoggersConfig = Field(
        default_factory=LoggersConfig,
        description=("Experiment trackers (MLflow, Weights & Biases) to log params, metrics, the best checkpoint and "
                     "the final export into; none by default."),
    )
    profiler: ProfilerConfig | None = Field(
        default=None,
        description=("Trace chosen training steps with `torch.profiler` into `MODEL_DIR/profile/`; `null`: off "
                     "(`cadence train --profile` turns it on with its defaults)."),
    )
    sweep_trial: SweepTrialConfig | None = Field(
        default=None,
        description=("Set by `cadence sweep` in each trial's `config.yaml`: the Optuna trial the run reports its "
                     "evaluations to and that may prune it; `null`: not a sweep trial."),
    )

    _config_dir: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _export_on_best_needs_best_checkpoint(self) -> ExperimentConfig:
        if self.export is not None and self.export.on == "best" and self.trainer.best_checkpoint is None:
            raise ValueError(
                "export.on is 'best' but trainer.best_checkpoint is not set (set it, or export.on: final)"
            )
        return self

    @model_validator(mode="after")
    def _lr_schedule_needs_train_steps(self) -> ExperimentConfig:
        schedule, steps = self.trainer.lr_schedule, self.trainer.train_steps
        if schedule is None:
            return self
        if schedule.decay_steps is not None:  # the horizon, checked against warmup_steps by the schedule's model
            return self
        if steps is None and self.trainer.max_epochs is None:
            raise ValueError(f"trainer.lr_schedule ({schedule.kind}) decays over trainer.train_steps, which is null, as is "
                             "trainer.max_epochs: set trainer.train_steps, trainer.max_epochs or trainer.lr_schedule.decay_steps")
        if steps is None:  # over max_epochs' steps, known once the train data is built (it needs a len())
            return self
        if schedule.warmup_steps > steps:
            raise ValueError(f"trainer.lr_schedule.warmup_steps ({schedule.warmup_steps}) is more than "
                             f"trainer.train_steps ({steps})")
        return self

    def require_model_dir(self) -> str:
        """``model_dir``; ConfigError when it is not set (neither in the file nor ``--model-dir``)."""
        return layout.require_model_dir(self.model_dir)

    @property
    def config_dir(self) -> Path | None:
        """Directory of the file this config was loaded from (``None`` if built in code)."""
        return self._config_dir

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data: by alias (``task.class``), class paths absolute.

        Raises ConfigError when a ``params`` holds something YAML cannot represent.
        """
        from cadence.config.yaml_io import plain_data

        data = self._resolved()
        data["task"]["params"] = plain_data(data["task"]["params"], "task.params")
        for i, entry in enumerate(data["callbacks"]):
            entry["params"] = plain_data(entry["params"], f"callbacks[{i}].params")
        return data

    def to_yaml(self) -> str:
        """The resolved config as YAML (see :meth:`to_dict`); :func:`~cadence.config.load_config`
        reads it back."""
        from cadence.config.yaml_io import dump_yaml

        return dump_yaml(self.to_dict())

    def __eq__(self, other: object) -> bool:
        """Equal when they describe the same experiment, wherever they were loaded from (or run in:
        ``workdir`` is not compared)."""
        if not isinstance(other, ExperimentConfig):
            return NotImplemented
        mine, theirs = self._resolved(), other._resolved()
        mine.pop("workdir"), theirs.pop("workdir")
        return mine == theirs

    def _resolved(self) -> dict[str, Any]:
        """``model_dump`` by alias, with every class path (task, callbacks) made absolute."""
        data = self.model_dump(by_alias=True)
        for entry in (data["task"], *data["callbacks"]):
            entry["class"] = resolve_class_path(entry["class"], self.config_dir)
        return data


def resolve_task_class(cfg: ExperimentConfig, config_dir: str | Path | None = None) -> str:
    """``task.class`` with a relative ``file.py`` made absolute, against ``config_dir``, else the
    directory the config was loaded from, else the current directory."""
    return resolve_class_path(cfg.task.class_path, config_dir if config_dir is not None else cfg.config_dir)
