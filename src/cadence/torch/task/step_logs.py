"""What a training loop accumulates from ``Task.train_step``'s outputs: the loss and the extra
scalar logs, summed on the device so that a loop syncs with the host once."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cadence.errors import TrainStepOutputError
from cadence.torch.task.task import Task

__all__ = ["FOLD", "ScalarSum", "add_extras", "split_output"]

FOLD = 4096
"""Values kept before they are folded into one on-device sum (bounds memory on long loops)."""


def split_output(task: Task, out: Any) -> tuple[torch.Tensor, Mapping[str, Any] | None]:
    """``(loss, extras)`` of what ``train_step`` returned: a loss tensor, or a dict with ``"loss"``
    (extras: the dict, None when it holds only the loss).

    Raises:
      TrainStepOutputError: (a ``TypeError``, CLI exit 2) no loss, or a loss that is not a scalar
        tensor with a gradient (checked from its metadata: no host sync), naming the task's
        ``train_step``, what it returned and what is expected.
    """
    name = f"{type(task).__name__}.train_step"
    if isinstance(out, torch.Tensor):
        loss, extras = out, None
    else:
        try:
            loss = out["loss"]
        except (KeyError, TypeError, IndexError) as e:
            raise TrainStepOutputError(
                f"{name} must return a loss tensor or a dict with 'loss', got {type(out).__name__}") from e
        extras = out if len(out) > 1 else None
    if not isinstance(loss, torch.Tensor):
        raise TrainStepOutputError(f"{name} returned a loss of type {type(loss).__name__}; expected a scalar tensor")
    if loss.numel() != 1:
        raise TrainStepOutputError(f"{name} returned a loss of shape {tuple(loss.shape)}; expected a scalar tensor "
                                   "(reduce it, e.g. loss.mean())")
    if not loss.requires_grad:
        raise TrainStepOutputError(f"{name} returned a loss that does not require grad (computed under "
                                   "torch.no_grad(), detached, or from no trainable parameter)")
    return loss, extras


class ScalarSum:
    """Sum of one extra log's values: tensors kept (on device) for one sum at the end, numbers summed."""

    __slots__ = ("tensors", "number", "count")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.number = 0.0
        self.count = 0


def add_extras(acc: dict[str, ScalarSum], out: Mapping[str, Any]) -> None:
    """Add ``out``'s extra scalar logs (all but ``loss``) into ``acc``; :class:`~cadence.errors.TrainStepOutputError`
    for one that is not a number or a 1-element tensor."""
    for key, v in out.items():
        if key == "loss":
            continue
        s = acc.get(key)
        if s is None:
            s = acc[key] = ScalarSum()
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise TrainStepOutputError(f"train_step log {key!r} must be a scalar, got shape {tuple(v.shape)}")
            s.tensors.append(v.detach().reshape(()).float())
            if len(s.tensors) >= FOLD:
                s.tensors[:] = [torch.stack(s.tensors).sum()]
        elif isinstance(v, (int, float)):
            s.number += float(v)
        else:
            raise TrainStepOutputError(
                f"train_step log {key!r} must be a number or a 1-element tensor, got {type(v).__name__}")
        s.count += 1
