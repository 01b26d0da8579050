"""One micro-batch's forward and backward pass in :class:`~cadence.torch.loop.trainer.TorchTrainer`'s
loop, for the cases beyond the inline one (autocast, a grad scaler, gradient accumulation, a
device to move the batch to)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from cadence.torch.task.step_logs import split_output
from cadence.torch.task.task import Task

__all__ = ["forward_backward"]


def forward_backward(task: Task, model: nn.Module, batch: Any, autocast: Any, scaler: Any,
                     k: int) -> tuple[torch.Tensor, Mapping[str, Any] | None]:
    """``task.train_step(model, batch)`` (under ``autocast`` when given), then backward of its loss
    divided by ``k`` (the micro-batches per step; scaled by ``scaler`` when given). Returns the
    undivided loss, detached (a scalar), and the step's extra outputs."""
    if autocast is None:
        out = task.train_step(model, batch)
    else:
        with autocast():
            out = task.train_step(model, batch)
    loss, extras = split_output(task, out)
    backward_loss = loss / k if k > 1 else loss
    if scaler is not None:
        backward_loss = scaler.scale(backward_loss)
    backward_loss.backward()
    loss = loss.detach()
    return (loss.reshape(()) if loss.dim() else loss), extras
