"""Learning-rate schedules built from the config (``trainer.lr_schedule``), so that the most common
ones need no hand-written ``LambdaLR``.

:func:`lr_factor` is the schedule as a function of the optimizer step; :func:`build_lr_schedule`
wraps it in a ``torch.optim.lr_scheduler.LambdaLR`` (stepped by the trainer once per optimizer
step; its state -- the step count and base learning rates -- is checkpointed like any
scheduler's, so a resumed run continues the curve exactly).
"""

from __future__ import annotations

import functools
import math

import torch

from cadence.config.components.lr_schedule import LR_SCHEDULE_KINDS, LRScheduleConfig

__all__ = ["KINDS", "build_lr_schedule", "lr_factor"]

KINDS = LR_SCHEDULE_KINDS
"""The schedules (the config's ``trainer.lr_schedule.kind``)."""


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """The factor of the optimizer's learning rate that optimizer step ``step`` (1-based) trains at.

    Warmup: step ``k <= warmup_steps`` trains at ``k / warmup_steps``. Then, with ``p = (k -
    warmup_steps) / (total_steps - warmup_steps)`` (at most 1: steps after ``total_steps`` stay at
    the end value), ``warmup_cosine``: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2``;
    ``warmup_linear``: ``1 - (1 - min_lr_ratio) * p``; ``warmup_constant``: 1. So the last step,
    ``total_steps``, trains at ``min_lr_ratio`` (cosine, linear).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown lr schedule {kind!r}; expected one of {', '.join(KINDS)}")
    if step <= warmup_steps:
        return step / warmup_steps
    if kind == "warmup_constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if kind == "warmup_linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _factor_after(steps_done: int, **schedule: object) -> float:
    # LambdaLR calls it with the number of scheduler steps taken: the next optimizer step is steps_done + 1.
    return lr_factor(steps_done + 1, **schedule)  # type: ignore[arg-type]


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, schedule: LRScheduleConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_factor` with ``schedule``'s settings
    (``trainer.lr_schedule``, checked when it is built) over ``total_steps`` (of every parameter
    group's learning rate), to be stepped once per optimizer step.

    Raises ``ValueError`` for ``total_steps < 1`` or ``schedule.warmup_steps`` above it.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if schedule.warmup_steps > total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {schedule.warmup_steps}")
    factor = functools.partial(_factor_after, kind=schedule.kind, warmup_steps=schedule.warmup_steps,
                               total_steps=total_steps, min_lr_ratio=schedule.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
