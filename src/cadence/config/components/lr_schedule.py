"""``trainer.lr_schedule``: the settings of a learning-rate schedule built by cadence
(:mod:`cadence.torch.components.lr_schedule` builds it)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from cadence.config.base import ConfigModel

__all__ = ["LR_SCHEDULE_KINDS", "LRScheduleConfig", "LRScheduleKind"]

LRScheduleKind = Literal["warmup_cosine", "warmup_linear", "warmup_constant"]
LR_SCHEDULE_KINDS: tuple[str, ...] = get_args(LRScheduleKind)
"""The learning-rate schedules ``trainer.lr_schedule.kind`` names."""


class LRScheduleConfig(ConfigModel):
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
