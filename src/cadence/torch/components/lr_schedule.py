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
from collections.abc import Callable

import torch

from cadence.errors import ConfigError
from cadence.config.components.lr_schedule import LR_SCHEDULE_CONVENTIONS, LR_SCHEDULE_KINDS, LRScheduleConfig

__all__ = ["CONVENTIONS", "KINDS", "build_lr_schedule", "lr_factor"]

KINDS = LR_SCHEDULE_KINDS
"""The schedules (the config's ``trainer.lr_schedule.kind``)."""

CONVENTIONS = LR_SCHEDULE_CONVENTIONS
"""How steps are counted (the config's ``trainer.lr_schedule.convention``)."""


def lr_factor(step: int, *, kind: str, warmup_steps: int, decay_steps: int, min_lr_ratio: float = 0.0,
              convention: str = "cadence") -> float:
    """The factor of the optimizer's learning rate that optimizer step ``step`` (1-based) trains at:
    :class:`~cadence.config.components.lr_schedule.LRScheduleConfig`'s formula. With ``i = step``
    (``cadence``) or ``step - 1`` (``huggingface``, ``nanogpt``), ``W = warmup_steps`` and ``D =
    decay_steps``: warmup ``i < W``: ``i / W`` (``(i + 1) / (W + 1)`` for ``nanogpt``); then ``p =
    min(1, (i - W) / (D - W))`` (1 past ``D`` when ``D <= W``) and ``warmup_cosine``: ``m + (1 - m) *
    (1 + cos(pi * p)) / 2``, ``warmup_linear``: ``1 - (1 - m) * p``, ``warmup_constant``: 1, with ``m =
    min_lr_ratio``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown lr schedule {kind!r}; expected one of {', '.join(KINDS)}")
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown lr schedule convention {convention!r}; expected one of {', '.join(CONVENTIONS)}")
    i = step if convention == "cadence" else step - 1
    if i < warmup_steps:
        return (i + 1) / (warmup_steps + 1) if convention == "nanogpt" else i / warmup_steps
    if kind == "warmup_constant":
        return 1.0
    if decay_steps <= warmup_steps:
        progress = 1.0 if i > decay_steps else 0.0
    else:
        progress = min(1.0, (i - warmup_steps) / (decay_steps - warmup_steps))
    if kind == "warmup_linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _factor_after(steps_done: int, **schedule: object) -> float:
    # LambdaLR calls it with the number of scheduler steps taken: the next optimizer step is steps_done + 1.
    return lr_factor(steps_done + 1, **schedule)  # type: ignore[arg-type]


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, schedule: LRScheduleConfig, *, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_factor` with ``schedule``'s settings
    (``trainer.lr_schedule``, checked when it is built), decaying over ``schedule.decay_steps`` or else
    ``total_steps`` (``trainer.train_steps``), to be stepped once per optimizer step. An absolute
    ``schedule.min_lr`` is each param group's ``min_lr_ratio`` (its minimum over its learning rate).

    Raises ``ValueError`` for a horizon below 1 or below ``schedule.warmup_steps``, and ``ConfigError``
    for a ``min_lr`` above a param group's learning rate.
    """
    decay_steps = schedule.decay_steps if schedule.decay_steps is not None else total_steps
    if decay_steps is None or decay_steps < 1:
        raise ValueError(f"the decay horizon (decay_steps, else train_steps) must be >= 1, got {decay_steps}")
    if schedule.warmup_steps > decay_steps:
        raise ValueError(f"warmup_steps must be in [0, {decay_steps}], got {schedule.warmup_steps}")
    ratios = [schedule.min_lr_ratio] * len(optimizer.param_groups)
    if schedule.min_lr is not None:
        rates = [float(group["lr"]) for group in optimizer.param_groups]
        if any(schedule.min_lr > rate for rate in rates):
            raise ConfigError(f"trainer.lr_schedule.min_lr ({schedule.min_lr}) is above the optimizer's learning "
                             f"rate ({min(rates)}): lower it")
        ratios = [schedule.min_lr / rate if rate else 0.0 for rate in rates]
    factors: list[Callable[[int], float]] = [
        functools.partial(_factor_after, kind=schedule.kind, warmup_steps=schedule.warmup_steps, decay_steps=decay_steps,
                          min_lr_ratio=ratio, convention=schedule.convention)
        for ratio in ratios
    ]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
