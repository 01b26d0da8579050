"""How many bytes a trainer's checkpoint holds, estimated from its tensors: the estimate
``checkpoint.async_save: auto`` decides the first save by (:data:`cadence.checkpoint.save_mode.StateSize`)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

__all__ = ["StateSizeEstimate"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:  # tied weights are saved once
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class StateSizeEstimate:
    """Callable: the bytes of ``model``'s parameters and buffers, ``optimizer``'s state and the
    ``ema``'s averaged weights (``averaged_state()``) as they are when called. Sharded tensors
    count at their global size (an over-estimate per rank)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, ema: Any = None) -> None:
        self.model, self.optimizer, self.ema = model, optimizer, ema

    def __call__(self) -> int:
        tensors: list[torch.Tensor] = [*self.model.parameters(), *self.model.buffers()]
        size = _nbytes(tensors)
        if self.optimizer is not None:
            size += _nbytes(_tensors(list(self.optimizer.state.values())))
        if self.ema is not None:
            size += _nbytes(self.ema.averaged_state().values())
        return size
