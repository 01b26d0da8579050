"""``trainer:``: how long to train, and when to checkpoint, validate and write summaries; with the
sections it holds that are not a component of their own (``best_checkpoint``, ``early_stopping``,
``recovery``). The components' settings (EMA, compile, activation checkpointing, LR
schedule, Slurm) are in
:mod:`cadence.config.components`."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from cadence.checkpoint.retention import DEFAULT_MAX_TO_KEEP
from cadence.config.base import MAX_SECONDS, ConfigModel
from cadence.config.components.activation_checkpoint import (
    ACTIVATION_CHECKPOINTING_FORM,
    ActivationCheckpointConfig,
    activation_checkpointing_shorthand,
)
from cadence.config.components.compile import COMPILE_FORM, CompileConfig, compile_shorthand
from cadence.config.components.ema import EMAConfig
from cadence.config.components.lr_schedule import LRScheduleConfig
from cadence.config.components.fault_tolerance import FaultToleranceConfig
from cadence.config.components.parallel import ParallelConfig
from cadence.config.components.slurm import SlurmConfig
from cadence.config.intervals import INTERVAL_FORM, check_interval_value

__all__ = ["BestCheckpointConfig", "EarlyStoppingConfig", "Precision", "RecoveryConfig", "Strategy", "TrainerConfig"]

Precision = Literal["32", "bf16", "fp16"]
Strategy = Literal["ddp", "fsdp"]

VALIDATION_STEPS_FORM = "-1 (the whole validation data) or an integer >= 1"
DEVICE_FORM = "'auto', 'cpu', 'cuda' or 'cuda:N'"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class BestCheckpointConfig(ConfigModel):
    """Keep the best checkpoint so far in `MODEL_DIR/best/` (with `best.json`)."""

    metric: str = Field(description="The eval metric to compare (a key, or `a/b` for a nested one).")
    higher_is_better: StrictBool = Field(
        default=True, description="`true`: larger is better (accuracy); `false`: smaller (loss).")


class EarlyStoppingConfig(ConfigModel):
    """Stop training when an eval metric stops improving."""

    metric: str = Field(description="The eval metric to watch.")
    patience: int = Field(ge=1, strict=True, description="Evaluations without improvement before stopping.")
    min_delta: float = Field(default=0.0, ge=0, description="An improvement must exceed this much.")
    higher_is_better: StrictBool = Field(default=True, description="`true`: larger is better; `false`: smaller.")


class RecoveryConfig(ConfigModel):
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


class TrainerConfig(ConfigModel):
    """How long to train, and when to checkpoint, validate and write summaries."""

    train_steps: int | None = Field(
        default=None, ge=1, strict=True,
        description=("Total optimizer steps to train for; `null` trains until the training data ends: a one-shot "
                     "iterator (a generator) runs out, or `max_epochs` are done."),
    )
    max_epochs: int | None = Field(
        default=None, ge=1, strict=True,
        description=("Epochs over a re-iterable train input (a `DataLoader`: iterated again, after `set_epoch(epoch)` "
                     "on it or its sampler, whenever it runs out); training ends at the end of this many, or at "
                     "`train_steps`, whichever comes first. `null`: no bound (then `train_steps` must be set for a "
                     "re-iterable input). The epoch (from 0) is logged as `epoch`."),
    )
    steps_per_loop: int = Field(
        default=100, ge=1, strict=True,
        description=("Steps per inner loop. Checkpoints, validation, summaries and actions happen at loop "
                     "boundaries, so every interval below is effectively rounded up to a multiple of it."),
    )
    checkpoint_interval: int | str | None = Field(
        default=1000, json_schema_extra={"expected": INTERVAL_FORM},
        description=("Save a checkpoint every this many steps, or epochs (`1ep`: at the end of every epoch; the "
                     "train data must have a `len()`, and the inner loops are then cut at these steps); `null` "
                     "saves only when training completes."),
    )
    validation_interval: int | str | None = Field(
        default=None, json_schema_extra={"expected": INTERVAL_FORM},
        description=("Validate every this many steps, or epochs (`2ep`: the train data must have a `len()`); `null` "
                     "validates once, at the end of training."),
    )
    eval_at_start: StrictBool = Field(
        default=False,
        description=("Also validate at step 0, before the first step of a fresh run: the untrained (or "
                     "`Task.initialize`d) weights, the baseline. Logged as any validation (summaries, trackers); "
                     "the actions do not see it (no `best_checkpoint` of step 0, no `early_stopping` count). A resumed "
                     "run does not repeat it; with a sidecar (no in-process validation) it is ignored with a "
                     "warning: `cadence evaluate --initial` evaluates the initialized model."),
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
                     "no difference. `trainer.parallel` replaces it when set."),
    )
    parallel: ParallelConfig | None = Field(
        default=None,
        description=("The device mesh: `{dp_replicate, dp_shard, tp}` degrees whose product is the world size "
                     "(one may be -1: the rest); HSDP with both `dp_` degrees > 1, tensor parallelism with `tp > 1` "
                     "(the Task's `parallelize`). Null: `trainer.strategy`'s 1-D mesh."),
    )
    fault_tolerance: FaultToleranceConfig | None = Field(
        default=None,
        description=("Fault-tolerant replica groups (torchft): each group a job of its own, a lost group costs the "
                     "others the step in flight, a restarted one heals from a live peer. Null: off."),
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, strict=True,
        description=("Micro-batches whose gradients are accumulated into each optimizer step, on each process. Each "
                     "micro-batch's loss is divided by it before `backward()` (the logged `loss` is the mean of the "
                     "undivided ones), so a loss averaged over its batch gives the gradient of the mean over the "
                     "step. Samples per step = per-rank batch x processes x `grad_accum_steps`: it is not divided "
                     "by the number of processes (nanoGPT divides its accumulation by the world size); keep the "
                     "samples per step under `--nproc N` with a global batch split over the ranks "
                     "(`ctx.per_rank_batch`)."),
    )
    grad_clip_norm: float | None = Field(
        default=None, gt=0, strict=True, allow_inf_nan=False,
        description="Clip the global gradient norm to this value; `null`: no clipping.",
    )
    lr_schedule: LRScheduleConfig | None = Field(
        default=None,
        description=("A learning-rate schedule built by cadence, e.g. `{kind: warmup_cosine, warmup_steps: 100, "
                     "min_lr_ratio: 0.1}`: decays over its `decay_steps`, else `train_steps`, else `max_epochs`' steps; "
                     "for a Task whose `build_lr_scheduler` returns `None` (giving both is an error). Its state is checkpointed "
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
    activation_checkpointing: ActivationCheckpointConfig | None = Field(
        default=None, json_schema_extra={"expected": ACTIVATION_CHECKPOINTING_FORM},
        description=("Recompute activations in backward instead of keeping them: `full` (every unit "
                     "`Task.fsdp_units` names), `{every: N}` (every N-th unit) or `none` / `null` (the default). "
                     "The same weights and checkpoint keys as without it."),
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
        default=None, gt=0, le=MAX_SECONDS, strict=True, allow_inf_nan=False,
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
    slurm: SlurmConfig = Field(
        default_factory=SlurmConfig,
        description="Under Slurm: requeue the job after the checkpoint of its time-limit signal (`requeue`).",
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
        return compile_shorthand(value)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _activation_checkpointing_shorthand(cls, value: Any) -> Any:
        return activation_checkpointing_shorthand(value)

    @model_validator(mode="after")
    def _check_strategy_precision(self) -> TrainerConfig:
        sharded = self.strategy == "fsdp" if self.parallel is None else (self.parallel.dp_shard != 1 or self.parallel.tp != 1)
        if sharded and self.precision == "fp16":
            where = "trainer.strategy 'fsdp'" if self.parallel is None else "trainer.parallel's sharding (dp_shard or tp)"
            raise ValueError(f"trainer.precision 'fp16' is not supported with {where} (use 'bf16' or '32')")
        if self.slurm.requeue and not self.save_on_preemption:
            raise ValueError("trainer.slurm.requeue needs trainer.save_on_preemption (the requeued job resumes "
                             "from the checkpoint that the signal makes the run commit)")
        return self

    @field_validator("checkpoint_interval", "validation_interval", mode="before")
    @classmethod
    def _check_interval(cls, value: Any) -> int | str | None:
        return check_interval_value(value)

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
