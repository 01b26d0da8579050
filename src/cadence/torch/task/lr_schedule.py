"""What a Task's LR scheduler is built with and returned as: :class:`TrainingPlan` (the length of
training, known when the scheduler is built) and :class:`LRSchedule` (a scheduler with when to step
it, Lightning's ``lr_scheduler_config``: ``interval`` and ``frequency``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LRInterval", "LRSchedule", "TrainingPlan"]

LRInterval = Literal["step", "epoch"]


@dataclass(frozen=True)
class TrainingPlan:
    """How long training is, as far as it is known when the LR scheduler is built (after the train
    input: ``Task.build_inputs("train", ctx)`` ran first).

    ``batches_per_epoch``: ``len()`` of the train input on this process (``None``: it has no length).
    ``steps_per_epoch``: optimizer steps per epoch, ``batches_per_epoch // grad_accum_steps`` (exact
    when ``grad_accum_steps`` divides it; otherwise an accumulation group spans two epochs).
    ``total_steps``: the last global step, when known: ``train_steps``, or ``max_epochs`` epochs'
    steps (``max_epochs * batches_per_epoch // grad_accum_steps``), whichever is smaller.
    """

    batches_per_epoch: int | None
    grad_accum_steps: int = 1
    max_epochs: int | None = None
    train_steps: int | None = None

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch (rounded down); ``None`` without a length."""
        if self.batches_per_epoch is None:
            return None
        return self.batches_per_epoch // self.grad_accum_steps

    @property
    def total_steps(self) -> int | None:
        """The last global step when known (see the class doc); ``None``: only the data's end tells."""
        by_epochs = None
        if self.max_epochs is not None and self.batches_per_epoch is not None:
            by_epochs = self.max_epochs * self.batches_per_epoch // self.grad_accum_steps
        known = [n for n in (self.train_steps, by_epochs) if n is not None]
        return min(known) if known else None


@dataclass(frozen=True)
class LRSchedule:
    """An LR scheduler and when the trainer steps it: ``interval="step"`` after every
    ``frequency``-th optimizer step (global step a multiple of it), ``"epoch"`` when every
    ``frequency``-th epoch of the train input ends (before the next epoch's first step; epochs
    counted from the start of training). Its state is in every checkpoint either way."""

    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler (or one with step/state_dict/load_state_dict)
    interval: LRInterval = "step"
    frequency: int = 1

    def __post_init__(self) -> None:
        if self.interval not in ("step", "epoch"):
            raise ValueError(f"LRSchedule.interval must be 'step' or 'epoch', got {self.interval!r}")
        if not isinstance(self.frequency, int) or isinstance(self.frequency, bool) or self.frequency < 1:
            raise ValueError(f"LRSchedule.frequency must be an int >= 1, got {self.frequency!r}")
