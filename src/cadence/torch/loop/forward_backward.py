"""One micro-batch's forward and backward pass in :class:`~cadence.torch.loop.trainer.TorchTrainer`'s
loop (:func:`forward_backward`), and one optimizer step's micro-batches (:func:`accumulate_step`), for
the cases beyond the inline one (autocast, a grad scaler, gradient accumulation, a device to move the
batch to)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from cadence.torch.data.batch import move_to_device
from cadence.torch.task.step_logs import ScalarSum, add_extras, split_output
from cadence.torch.task.task import Task

if TYPE_CHECKING:
    from cadence.torch.loop.train_data import TrainData

__all__ = ["accumulate_step", "forward_backward"]


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


def accumulate_step(task: Task, model: nn.Module, it: Iterator[Any], consumed: int, data: TrainData, k: int,
                    count: Callable[[Any], None] | None, device: torch.device | None, no_sync: Any, autocast: Any,
                    scaler: Any, losses: list[torch.Tensor], extras_acc: dict[str, ScalarSum],
                    epoch_started: Callable[[], None]) -> tuple[Iterator[Any], int, bool]:
    """One optimizer step's ``k`` micro-batches from ``it`` (the next epoch's when it runs out:
    ``data.next_epoch``, then ``epoch_started()``), each counted (``count``), moved to ``device``
    (``None``: left where it is) and run through :func:`forward_backward` (under ``no_sync`` but for
    the last); their losses appended to ``losses``, their extras added to ``extras_acc``. Returns the
    running iterator, the batches drawn from it not yet counted in ``data`` (``consumed``, in), and
    whether the data ended: then the step's losses are dropped (the caller zeroes its gradients)."""
    step_start = len(losses)
    step_extras: list[Mapping[str, Any]] = []
    for micro in range(k):
        try:
            batch = next(it)
        except StopIteration:
            started, consumed = data.next_epoch(consumed), 0
            if started is None:  # data ran out inside the accumulation group: drop the group
                del losses[step_start:]
                return it, consumed, True
            it, batch = started
            epoch_started()
        consumed += 1
        if count is not None:
            count(batch)
        if device is not None:
            batch = move_to_device(batch, device)
        if no_sync is not None and micro < k - 1:
            with no_sync():
                loss, extras = forward_backward(task, model, batch, autocast, scaler, k)
        else:
            loss, extras = forward_backward(task, model, batch, autocast, scaler, k)
        losses.append(loss)
        if extras is not None:
            step_extras.append(extras)
    for extras in step_extras:
        add_extras(extras_acc, extras)
    return it, consumed, False
