"""The run's intervals in optimizer steps: ``trainer.checkpoint_interval`` and
``trainer.validation_interval`` given in epochs (``"1ep"``) are converted once the train input's
length is known (:func:`cadence.config.intervals.interval_steps`), before the model dir is written."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from cadence.config.intervals import interval_epochs, interval_steps
from cadence.config.trainer import TrainerConfig

__all__ = ["StepIntervals", "resolve_intervals"]


@dataclass(frozen=True)
class StepIntervals:
    """The controller's intervals, in steps (``None``: none), and its ``steps_per_loop``: cut at the
    multiples of a checkpoint interval given in epochs, so that the checkpoints fall on the epochs'
    ends (validation segments are cut at theirs by the controller)."""

    checkpoint: int | None
    validation: int | None
    steps_per_loop: int | Callable[[int], int]


def resolve_intervals(t: TrainerConfig, batches_per_epoch: int | None) -> StepIntervals:
    """``t``'s intervals in steps, for a train input of ``batches_per_epoch`` batches (``None``: no
    length); :class:`~cadence.errors.ConfigError` naming the field for one in epochs that cannot
    be converted."""
    steps = functools.partial(interval_steps, batches_per_epoch=batches_per_epoch, grad_accum_steps=t.grad_accum_steps)
    checkpoint = steps("trainer.checkpoint_interval", t.checkpoint_interval)
    validation = steps("trainer.validation_interval", t.validation_interval)
    per_loop: int | Callable[[int], int] = t.steps_per_loop
    if checkpoint is not None and interval_epochs(t.checkpoint_interval) is not None and checkpoint % t.steps_per_loop:
        per_loop = functools.partial(_loop_to_boundary, t.steps_per_loop, checkpoint)
    return StepIntervals(checkpoint, validation, per_loop)


def _loop_to_boundary(steps_per_loop: int, every: int, step: int) -> int:
    """The inner loop starting at ``step``: ``steps_per_loop`` steps, ending at the next multiple of ``every`` at most."""
    return min(steps_per_loop, every - step % every)
