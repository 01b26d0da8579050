"""What runs after each optimizer step of the training loop: :class:`StepHook`.

The one per-step extension point of :class:`~cadence.torch.TorchTrainer` (an EMA of the weights,
the profiler's schedule). A trainer without hooks pays nothing per step; keep each hook's work
small: it runs on the training thread, between steps.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["StepHook"]


@runtime_checkable
class StepHook(Protocol):
    """Called by :meth:`TorchTrainer.train` after each optimizer step (after the LR scheduler's
    step), on every rank, with the global step just completed (1 after the first step)."""

    def after_step(self, global_step: int) -> None: ...
