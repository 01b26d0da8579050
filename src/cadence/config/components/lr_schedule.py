"""``trainer.lr_schedule``: the settings of a learning-rate schedule built by cadence
(:mod:`cadence.torch.components.lr_schedule` builds it)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from cadence.config.base import MAX_INT, ConfigModel

__all__ = ["LR_SCHEDULE_CONVENTIONS", "LR_SCHEDULE_KINDS", "LRScheduleConfig", "LRScheduleConvention", "LRScheduleKind"]

LRScheduleKind = Literal["warmup_cosine", "warmup_linear", "warmup_constant"]
LR_SCHEDULE_KINDS: tuple[str, ...] = get_args(LRScheduleKind)
"""The learning-rate schedules ``trainer.lr_schedule.kind`` names."""

LRScheduleConvention = Literal["cadence", "huggingface", "nanogpt"]
LR_SCHEDULE_CONVENTIONS: tuple[str, ...] = get_args(LRScheduleConvention)
"""How ``trainer.lr_schedule.convention`` counts steps (see :class:`LRScheduleConfig`)."""


class LRScheduleConfig(ConfigModel):
    """A learning-rate schedule built by cadence (for a Task whose `build_lr_scheduler` returns `None`):
    the optimizer's learning rate times a factor, stepped once per optimizer step. With `W` =
    `warmup_steps`, `D` = `decay_steps` and the minimum factor `m` (`min_lr_ratio`, or `min_lr` over a
    param group's learning rate), optimizer step `k` (1-based: global step `k` trains at it) is
    indexed `i = k` (`convention: cadence`) or `i = k - 1` (`huggingface`, `nanogpt`). Warmup, `i < W`:
    `i / W` (`cadence`, `huggingface`; so `cadence` trains step `W` at 1 and `huggingface` trains step
    1 at 0) or `(i + 1) / (W + 1)` (`nanogpt`). Then, with `p = min(1, (i - W) / (D - W))`:
    `m + (1 - m) * (1 + cos(pi * p)) / 2` (`warmup_cosine`), `1 - (1 - m) * p` (`warmup_linear`) or 1
    (`warmup_constant`); past `D` it holds at `m`. `huggingface` is transformers'
    `get_cosine_schedule_with_warmup` (`get_linear_...`, `get_constant_...`; with `min_lr_ratio`, its
    `..._with_min_lr`) over `num_training_steps = D`; `nanogpt` is nanoGPT's `get_lr(it)` with
    `warmup_iters = W`, `lr_decay_iters = D` and `it = k - 1`. torchtitan warms up as `nanogpt` does
    but decays over `(i + 1 - W) / (D' + 1)` with `D'` decay steps: none of these."""

    kind: LRScheduleKind = Field(
        description="The shape after the warmup: `warmup_cosine`, `warmup_linear` or `warmup_constant`.",
    )
    warmup_steps: int = Field(
        default=0, ge=0, strict=True, description="Optimizer steps of linear warmup from the start; `0`: none.",
    )
    decay_steps: int | None = Field(
        default=None, ge=1, le=MAX_INT, strict=True,
        description=("The decay horizon `D`: the step index at which the factor reaches its minimum, held after it "
                     "(nanoGPT's `lr_decay_iters`); `null`: `trainer.train_steps`, else the steps of `trainer.max_epochs` "
                     "epochs (a train input with a `len()`). At least `warmup_steps`."),
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, allow_inf_nan=False,
        description="The factor reached at `decay_steps` (a fraction of the optimizer's learning rate).",
    )
    min_lr: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description=("The learning rate reached at `decay_steps`, absolute (every param group's; at most its "
                     "learning rate); instead of `min_lr_ratio`, not with it."),
    )
    convention: LRScheduleConvention = Field(
        default="cadence",
        description=("How steps are counted (see above): `cadence` (step `k` of the warmup trains at `k / W`, step "
                     "`D` at the minimum), `huggingface` (transformers' schedules: step 1 trains at 0) or `nanogpt` "
                     "(nanoGPT's `get_lr`: step `k` of the warmup trains at `k / (W + 1)`)."),
    )

    @model_validator(mode="after")
    def _one_minimum(self) -> LRScheduleConfig:
        if self.min_lr is not None and "min_lr_ratio" in self.model_fields_set:
            raise ValueError("min_lr and min_lr_ratio are both set: give one (min_lr is absolute, "
                             "min_lr_ratio a fraction of the optimizer's learning rate)")
        if self.decay_steps is not None and self.warmup_steps > self.decay_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) is more than decay_steps ({self.decay_steps})")
        return self
