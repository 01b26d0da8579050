"""The experiment config's schema: one pydantic model per section, each field with its default,
bounds and meaning -- the one place they are written. ``docs/config.md`` is generated from it, and
every "expected ..." in an error message is derived from it (:mod:`cadence.config.errors`): a
field whose accepted values need other words than its type says declares them as
``json_schema_extra={"expected": ...}``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, field_validator, model_validator

from cadence import layout
from cadence.actions.export_files import DEFAULT_MAX_EXPORTS
from cadence.checkpoint.checksum import DEFAULT_ALGORITHM, Algorithm
from cadence.checkpoint.leases import DEFAULT_LEASE_TTL
from cadence.checkpoint.retention import DEFAULT_MAX_TO_KEEP
from cadence.checkpoint.writer_lease import DEFAULT_WRITER_LEASE_TTL
from cadence.config.class_paths import CLASS_SPEC_FORM, check_class_spec, resolve_class_path

__all__ = [
    "EXPORT_FORMATS",
    "MOVED_KEYS",
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

Precision = Literal["32", "bf16", "fp16"]
Strategy = Literal["ddp", "fsdp"]
ExportFormat = Literal["safetensors", "torch_export", "torchscript", "onnx"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
"""Every inference format, in the order the docs list them (the CLI's choices, the exporters')."""
_FORMAT_NOTES = {"torch_export": " (.pt2)", "onnx": " (needs `cadence[onnx]`)"}

VALIDATION_STEPS_FORM = "-1 (the whole validation data) or an integer >= 1"
DEVICE_FORM = "'auto', 'cpu', 'cuda' or 'cuda:N'"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

MOVED_KEYS: dict[tuple[str, ...], str] = {
    ("trainer", "async_checkpoint"): "checkpoint.async_save",
    ("trainer", "throttle_secs"): "eval_spec.throttle_secs",
    ("trainer", "start_delay_secs"): "eval_spec.start_delay_secs",
}
"""Keys of earlier versions and where they live now: an error names the new key."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_means_empty(cls, data: Any) -> Any:
        """A section, mapping or list of sections with every entry commented out is YAML ``null``:
        read as empty. (Where null is a value of its own, ``X | None``, it stays null.)"""
        if not isinstance(data, dict):
            return data
        empty = _empty_values(cls)
        return {k: (empty[k]() if v is None and k in empty else v) for k, v in data.items()}


@functools.cache
def _empty_values(model: type[BaseModel]) -> dict[str, type[dict[str, Any]] | type[list[Any]]]:
    """The keys (names and aliases) of ``model``'s fields that hold sections or mappings, each with
    the type of its empty value (``dict`` or ``list``)."""
    out: dict[str, type[dict[str, Any]] | type[list[Any]]] = {}
    for name, info in model.model_fields.items():
        annotation, origin = info.annotation, get_origin(info.annotation)
        if _is_section(annotation) or (isinstance(origin, type) and issubclass(origin, Mapping)):
            out[name] = out[info.alias or name] = dict
        elif origin is list and _is_section(get_args(annotation)[0]):
            out[name] = out[info.alias or name] = list
    return out


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


class ClassSpec(_Model):
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


TaskConfig = ClassSpec
"""``task:``: the Task class (a ``cadence.torch.Task``) and its keyword arguments."""
CallbackConfig = ClassSpec
"""``callbacks[i]``: a ``cadence.Callback`` class and its keyword arguments."""


class BestCheckpointConfig(_Model):
    """Keep the best checkpoint so far in `MODEL_DIR/best/` (with `best.json`)."""

    metric: str = Field(description="The eval metric to compare (a key, or `a/b` for a nested one).")
    higher_is_better: StrictBool = Field(
        default=True, description="`true`: larger is better (accuracy); `false`: smaller (loss).")


class EarlyStoppingConfig(_Model):
    """Stop training when an eval metric stops improving."""

    metric: str = Field(description="The eval metric to watch.")
    patience: int = Field(ge=1, strict=True, description="Evaluations without improvement before stopping.")
    min_delta: float = Field(default=0.0, ge=0, description="An improvement must exceed this much.")
    higher_is_better: StrictBool = Field(default=True, description="`true`: larger is better; `false`: smaller.")


class RecoveryConfig(_Model):
    """Roll back to the latest checkpoint when the training loss diverges (NaN/inf, or above a bound)."""

    loss_upper_bound: float | None = Field(
        default=None, description="A loss above this counts as diverged too; `null`: only NaN/inf."
    )
    recovery_begin_steps: int = Field(
        default=0, ge=0, strict=True, description="The upper bound applies from this global step on."
    )
    max_trials: int = Field(
        default=3, ge=0, strict=True, description="Recoveries allowed over the run; the next divergence fails the run."
    )


class ExportConfig(_Model):
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


LRScheduleKind = Literal["warmup_cosine", "warmup_linear", "warmup_constant"]
LR_SCHEDULE_KINDS: tuple[str, ...] = get_args(LRScheduleKind)
"""The learning-rate schedules ``trainer.lr_schedule.kind`` names (built by ``cadence.torch.components.lr_schedule``)."""


class LRScheduleConfig(_Model):
    """A learning-rate schedule built by cadence (for a Task whose `build_lr_scheduler` returns `None`):
    the optimizer's learning rate times a factor, stepped once per optimizer step. The factor rises
    linearly over `warmup_steps` (step `k` of them trains at `k / warmup_steps`), then decays from 1 to
    `min_lr_ratio` at `trainer.train_steps`: along a half cosine (`warmup_cosine`), a line
    (`warmup_linear`), or stays at 1 (`warmup_constant`)."""

    kind: LRScheduleKind = Field(
        description="The shape after the warmup: `warmup_cosine`, `warmup_linear` or `warmup_constant`.",
    )
    warmup_steps: int = Field(
        default=0, ge=0, strict=True, description="Optimizer steps of linear warmup from the start; `0`: none.",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, allow_inf_nan=False,
        description="The factor reached at `trainer.train_steps` (a fraction of the optimizer's learning rate).",
    )


class EMAConfig(_Model):
    """An exponential moving average (EMA) of the weights, kept on the device beside them (one more copy of
    the floating-point parameters and buffers; under `fsdp` sharded like the parameters). At every global step
    that is a multiple of `every_n_steps`: at a step up to `start_step` the EMA is set to the weights; after
    it, `ema = decay * ema + (1 - decay) * weights` (the decay applies per update, not per step). Float
    buffers (BatchNorm statistics) are averaged too; integer ones are the model's. Every checkpoint holds it
    (`ema.safetensors`, or the `ema` shards); evaluations (in-process, sidecar, `cadence evaluate`) report
    the EMA weights' metrics under their plain names, which `best_checkpoint` and `early_stopping` see, and
    exports are of the EMA weights."""

    decay: float = Field(
        default=0.999, gt=0, lt=1, allow_inf_nan=False,
        description="Weight of the old average in each update; the average spans about `every_n_steps / (1 - decay)` steps.",
    )
    start_step: int = Field(
        default=0, ge=0, strict=True,
        description="Updates at global steps up to this one copy the weights; averaging starts after it.",
    )
    every_n_steps: int = Field(
        default=1, ge=1, strict=True, description="Update the EMA at every global step that is a multiple of this.",
    )
    evaluate_raw: StrictBool = Field(
        default=True,
        description="Also evaluate the raw (not averaged) weights, reported as `raw/<metric>` (a second evaluation).",
    )


CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_FORM = "true, false, a mapping {backend, mode, fullgraph, dynamic}"


class CompileConfig(_Model):
    """`torch.compile` of the model's forward (and so its backward), in place: the module and its
    `state_dict` keys stay as they are, so checkpoints are the same as an eager run's (no `_orig_mod.`
    prefix) and resume either way. One process and DDP compile the whole model (before the DDP wrap);
    `fsdp` on several ranks compiles each unit `Task.fsdp_units` names before sharding it (the rest runs
    eagerly). The evaluator shares the model and runs compiled too (so do the sidecar and `cadence
    evaluate`); exports always trace the eager forward. Costs: the first training step and the first
    evaluation each compile (seconds on small models, minutes on large ones, in every process: each rank,
    each sidecar, each resume), and a new input shape, dtype or mode may compile again (a last, smaller
    batch: once, as a dynamic shape); steps after it run faster where the backend's kernels pay (GPUs
    mostly; on CPU often little). A failure to compile stops the run with one line (exit 2)."""

    backend: str = Field(
        default="inductor", min_length=1,
        description=("`torch.compile`'s backend: `inductor` (generated kernels), or another name "
                     "`torch._dynamo.list_backends()` knows (`aot_eager`: traced, no kernels of its own; checked "
                     "when the model is built)."),
    )
    mode: CompileMode = Field(
        default="default",
        description=("inductor's mode: `default`, `reduce-overhead` (CUDA graphs: less launch overhead, more "
                     "memory), `max-autotune` (benchmarks kernel choices: a much longer compile) or "
                     "`max-autotune-no-cudagraphs`. Other backends take none."),
    )
    fullgraph: StrictBool = Field(
        default=False,
        description="`true`: a graph break (code dynamo cannot trace) is an error instead of running that part eagerly.",
    )
    dynamic: StrictBool | None = Field(
        default=None, json_schema_extra={"expected": "true or false"},
        description=("`true`: compile for dynamic shapes from the start; `false`: one graph per shape; `null`: "
                     "static first, dynamic once a shape changes (torch's default)."),
    )

    @model_validator(mode="after")
    def _mode_is_inductor_s(self) -> CompileConfig:
        if self.mode != "default" and self.backend != "inductor":
            raise ValueError(f"mode {self.mode!r} is inductor's; backend {self.backend!r} takes no mode")
        return self


class SidecarConfig(_Model):
    """The sidecar evaluator (`cadence evaluate --continuous`, `cadence launch --sidecar`)."""

    mode: Literal["every", "latest"] = Field(
        default="every", description="`every`: each committed checkpoint in step order; `latest`: jump to the newest."
    )
    timeout: float | None = Field(
        default=3600.0, ge=0,
        description="Stop after this many seconds without a new checkpoint (a dead trainer); `null`: wait for `FINAL`.",
    )
    poll_interval: float = Field(default=0.5, gt=0, description="Seconds between looks for new checkpoints.")
    max_pending: int | None = Field(
        default=8, ge=1, strict=True,
        description="Unevaluated checkpoints protected from the trainer's retention; the oldest beyond it are skipped.",
    )
    max_evaluations: int | None = Field(
        default=None, ge=1, strict=True, description="Stop after this many evaluations in total; `null`: no limit."
    )
    lease_ttl: float = Field(
        default=DEFAULT_LEASE_TTL, gt=0, description="Seconds a lease lives without renewal (a killed sidecar's lease ends then)."
    )
    name: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$", max_length=64,
        json_schema_extra={"expected": "a name of letters, digits, '_', '-' and '.' (not first; at most 64 characters)"},
        description="Write to `eval_<name>/` instead of `eval/` (several sidecars on one model dir).",
    )
    max_retries: int = Field(
        default=3, ge=0, strict=True,
        description="A committed checkpoint that fails to load is retried this many times, then recorded as failed.",
    )
    retry_backoff: float = Field(
        default=0.5, gt=0, description="Seconds before the first retry; each further retry waits twice as long.",
    )


class TrainerConfig(_Model):
    """How long to train, and when to checkpoint, validate and write summaries."""

    train_steps: int | None = Field(
        default=None, ge=1, strict=True,
        description="Total optimizer steps to train for; `null` trains until the training data is exhausted.",
    )
    steps_per_loop: int = Field(
        default=100, ge=1, strict=True,
        description=("Steps per inner loop. Checkpoints, validation, summaries and actions happen at loop "
                     "boundaries, so every interval below is effectively rounded up to a multiple of it."),
    )
    checkpoint_interval: int | None = Field(
        default=1000, ge=1, strict=True,
        description="Save a checkpoint every this many steps; `null` saves only when training completes.",
    )
    validation_interval: int | None = Field(
        default=None, ge=1, strict=True,
        description="Validate every this many steps; `null` validates once, at the end of training.",
    )
    validation_steps: int = Field(
        default=-1, strict=True, json_schema_extra={"expected": VALIDATION_STEPS_FORM},
        description="Batches per validation; `-1` uses the whole validation data.",
    )
    sanity_val_steps: int = Field(
        default=2, ge=0, strict=True,
        description=("Before training (also when resuming), run this many validation batches, without writing "
                     "anything, and check the eval metrics that `best_checkpoint` and `early_stopping` name: a "
                     "wrong `validation_step` or metric name fails (exit 2) before any step is trained. `0`: off."),
    )
    max_to_keep: int | None = Field(
        default=DEFAULT_MAX_TO_KEEP, ge=0, strict=True,
        description="Keep the newest this many checkpoints (`0`: none besides the kept ones below); `null` keeps all.",
    )
    keep_every_n_steps: int | None = Field(
        default=None, ge=1, strict=True,
        description="Also keep, forever, the checkpoints whose step is a multiple of this; `null`: no such rule.",
    )
    summary_interval: int | None = Field(
        default=None, ge=1, strict=True,
        description="Write training summaries every this many steps (a multiple of `steps_per_loop`); `null`: every loop.",
    )
    seed: int = Field(
        default=0, ge=0, le=2**32 - 1, strict=True, json_schema_extra={"expected": "an integer from 0 to 2**32 - 1"},
        description="Seed for the Python, NumPy and torch random number generators.",
    )
    precision: Precision = Field(
        default="32",
        description='Numeric precision: `"32"` (full), `"bf16"` or `"fp16"` (mixed precision with autocast).',
    )
    strategy: Strategy = Field(
        default="ddp",
        description=("Data parallelism over several ranks: `ddp` (a replica of the model on every rank, "
                     "gradients all-reduced) or `fsdp` (FSDP2: parameters, gradients and optimizer state "
                     "sharded over the ranks, in the units `Task.fsdp_units` names; `bf16` all-gathers "
                     "parameters in bfloat16 and reduces gradients in float32; not with `fp16`; checkpoints are "
                     "sharded: every rank writes its shards, loadable on any number of ranks). One process: "
                     "no difference."),
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, strict=True, description="Micro-batches whose gradients are accumulated into each optimizer step.",
    )
    grad_clip_norm: float | None = Field(
        default=None, gt=0, strict=True, allow_inf_nan=False,
        description="Clip the global gradient norm to this value; `null`: no clipping.",
    )
    lr_schedule: LRScheduleConfig | None = Field(
        default=None,
        description=("A learning-rate schedule built by cadence, e.g. `{kind: warmup_cosine, warmup_steps: 100, "
                     "min_lr_ratio: 0.1}`: decays over `train_steps` (which must be set); for a Task whose "
                     "`build_lr_scheduler` returns `None` (giving both is an error). Its state is checkpointed "
                     "like any scheduler's. `null`: none."),
    )
    ema: EMAConfig | None = Field(
        default=None,
        description=("Keep an exponential moving average of the weights, e.g. `{decay: 0.999}`; evaluations and "
                     "exports use it. `null`: off."),
    )
    compile: CompileConfig | None = Field(
        default=None, json_schema_extra={"expected": COMPILE_FORM},
        description=("`torch.compile` the model: `true` (inductor, its defaults), or a mapping, e.g. `{backend: "
                     "inductor, mode: max-autotune, fullgraph: true}`; checkpoints are the same as an eager run's. "
                     "`false` / `null` (the default): eager."),
    )
    device: str = Field(
        default="auto", json_schema_extra={"expected": DEVICE_FORM},
        description="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.",
    )
    best_checkpoint: BestCheckpointConfig | None = Field(
        default=None, description="Keep the best checkpoint in `best/`; `null`: off."
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        default=None, description="Stop when an eval metric plateaus; `null`: off."
    )
    recovery: RecoveryConfig | None = Field(
        default=None, description="Roll back on a diverged loss; `null`: off (a NaN loss is only logged)."
    )
    in_process_validation: StrictBool = Field(
        default=True,
        description="Evaluate inside `cadence train`; `false`: only train (a sidecar evaluates the checkpoints).",
    )
    hang_timeout: float | None = Field(
        default=None, gt=0, strict=True, allow_inf_nan=False,
        description=("Seconds without progress (no training step, evaluation batch or checkpoint) after which a "
                     "rank logs where it is stuck (phase, step, stacks) and exits 124, for the launcher to "
                     "restart the job from its last checkpoint (`cadence train --max-restarts`); longer than "
                     "the slowest step, evaluation batch, save or export of the best model. `null`: no watchdog."),
    )
    peak_tflops: float | None = Field(
        default=None, gt=0, strict=True, allow_inf_nan=False,
        description=("The peak TFLOP/s of one device at the run's precision, for model FLOP utilisation (`mfu` in "
                     "the train summaries: the model's training FLOP/s per device over this peak); the FLOPs per "
                     "sample come from `Task.flops_per_sample()` or are counted once by cadence. `null`: a CUDA "
                     "GPU's dense tensor-core peak from cadence's table (A100, H100, H200, L4, L40S, ...), no MFU on "
                     "other devices."),
    )
    log_throughput: StrictBool = Field(
        default=True,
        description=("Log each loop's throughput in the train summaries and the progress line: `samples_per_second` "
                     "(`Task.batch_size_of` of every batch), `tokens_per_second` (with `Task.tokens_per_batch`), "
                     "`model_tflops_per_second` and `mfu` (see `peak_tflops`), and on CUDA "
                     "`memory/peak_allocated_gib` and `memory/peak_reserved_gib`. `false`: only `steps_per_second`; "
                     "nothing is counted per batch and no FLOPs are counted."),
    )
    save_on_preemption: StrictBool = Field(
        default=True,
        description="On SIGTERM, SIGUSR1 or SIGINT, commit a checkpoint at the end of the current loop and exit 0.",
    )

    @field_validator("validation_steps")
    @classmethod
    def _check_validation_steps(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"expected {VALIDATION_STEPS_FORM}")
        return value

    @field_validator("precision", mode="before")
    @classmethod
    def _normalise_precision(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value == 32:
            return "32"
        if isinstance(value, str):
            return value.strip().lower()
        return value

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_shorthand(cls, value: Any) -> Any:
        """``true``: compile with the defaults; ``false``: off (as null)."""
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _check_strategy_precision(self) -> TrainerConfig:
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError("trainer.precision 'fp16' is not supported with trainer.strategy 'fsdp' "
                             "(use 'bf16' or '32')")
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        value = value.strip()
        if not _DEVICE_RE.match(value):
            raise ValueError(f"expected {DEVICE_FORM}")
        return value

    @field_validator("summary_interval")
    @classmethod
    def _check_summary_interval(cls, value: int | None, info: Any) -> int | None:
        steps_per_loop = info.data.get("steps_per_loop")
        if value is not None and steps_per_loop and value % steps_per_loop:
            raise ValueError(f"must be a multiple of trainer.steps_per_loop ({steps_per_loop})")
        return value


class CheckpointConfig(_Model):
    """How checkpoints are written (the CheckpointManager's own settings; what is kept is `trainer:`'s)."""

    async_save: StrictBool = Field(
        default=False,
        description=(
            "Copy the state to CPU memory at a save and commit it from a background thread (one save in "
            "flight); the copy is reused by the next save, so one extra CPU copy of the state stays resident."
        ),
    )
    writer_lease_ttl: float = Field(
        default=DEFAULT_WRITER_LEASE_TTL, gt=0, allow_inf_nan=False,
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


class EvalSpecConfig(_Model):
    """tf.estimator's `EvalSpec` throttling of the in-process evaluations of `cadence train`."""

    throttle_secs: float = Field(
        default=0.0, ge=0,
        description=("Skip an in-process evaluation due sooner than this after the previous one started "
                     "(never the final)."),
    )
    start_delay_secs: float = Field(
        default=0.0, ge=0,
        description="Skip in-process evaluations due in the first this many seconds (never the final).",
    )


class MLflowConfig(_Model):
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


class WandbConfig(_Model):
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


class ProfilerConfig(_Model):
    """`torch.profiler` traces of chosen training steps (`cadence train --profile` turns it on with these
    defaults: steps 13-15). The window is `torch.profiler.schedule`'s, in global steps (a resumed run keeps it):
    steps 1 to `skip_first` are skipped, then each cycle waits `wait` steps, warms up `warmup` and records
    `active` into one trace per rank, `MODEL_DIR/profile/rank<R>.<time>.pt.trace.json` (TensorBoard's profiler
    plugin, Perfetto, chrome://tracing). No profiler exists outside the warmup and recorded steps; an
    evaluation or checkpoint between loops inside them is recorded too, and the step that ends a cycle
    waits for its trace to be written. A cycle is cut at `trainer.train_steps`; a run resumed inside a cycle's
    recorded steps skips that cycle."""

    skip_first: int = Field(
        default=10, ge=0, strict=True,
        description="Global steps before the first cycle (its first wait step is `skip_first + 1`).",
    )
    wait: int = Field(default=1, ge=0, strict=True, description="Steps at the start of each cycle without a profiler.")
    warmup: int = Field(
        default=1, ge=0, strict=True,
        description=("Steps profiled and discarded before the recorded ones (the profiler's own start-up); "
                     "0 skews the first recorded step."),
    )
    active: int = Field(default=3, ge=1, strict=True, description="Steps recorded into each trace.")
    repeat: int = Field(default=1, ge=0, strict=True, description="How many cycles; 0: cycle after cycle until training ends.")
    record_shapes: StrictBool = Field(
        default=False,
        description="Record every op's input shapes (the plugin groups ops by shape); more time per op, bigger traces.",
    )
    profile_memory: StrictBool = Field(
        default=False,
        description="Track every tensor allocation and free (the memory view); more time per op, bigger traces.",
    )
    with_stack: StrictBool = Field(
        default=False,
        description=("Record the Python stack (file:line) of every op (the plugin's call stacks); more time per op "
                     "and traces about 3x bigger."),
    )
    gzip: StrictBool = Field(
        default=False,
        description="Write `.pt.trace.json.gz` (about 10x smaller; the plugin and Perfetto read both).",
    )


class LoggersConfig(_Model):
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


class PrunerConfig(_Model):
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


class SweepTrialConfig(_Model):
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


class ExperimentConfig(_Model):
    """A whole experiment: where it writes, what it trains, and how."""

    model_dir: str | None = Field(
        default=None, json_schema_extra={"expected": "a path or URL (a string)"},
        description=("The model directory (checkpoints, summaries, exports): a local path or an fsspec URL. The "
                     "CLI's `--model-dir` overrides it."),
    )
    task: TaskConfig = Field(description="The Task (a subclass of `cadence.torch.Task`): what model, data and loss to train.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The training loop's schedule and numerics.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="How checkpoints are written.")
    eval_spec: EvalSpecConfig = Field(
        default_factory=EvalSpecConfig, description="tf.estimator's throttling of in-process evaluations."
    )
    sidecar: SidecarConfig = Field(default_factory=SidecarConfig, description="The sidecar evaluator's settings.")
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
        if steps is None:
            raise ValueError(f"trainer.lr_schedule ({schedule.kind}) decays over trainer.train_steps, which is null: "
                             "set trainer.train_steps")
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
        """Equal when they describe the same experiment, wherever they were loaded from."""
        if not isinstance(other, ExperimentConfig):
            return NotImplemented
        return self._resolved() == other._resolved()

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
