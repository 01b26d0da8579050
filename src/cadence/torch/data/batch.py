"""Walking nested batches: device placement and finding the batch size."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Return ``batch`` with every tensor in nested tuples / lists / dicts moved to ``device``.

    Other leaves are returned unchanged; named tuples and dict subclasses keep their type where
    they can be rebuilt from their items.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        items = {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
        if type(batch) is dict:
            return items
        rebuild: Any = type(batch)
        try:
            return rebuild(items)
        except Exception:  # e.g. defaultdict, custom mappings
            return items
    if isinstance(batch, tuple):
        moved = [move_to_device(v, device, non_blocking) for v in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*moved)
        return tuple(moved)
    if isinstance(batch, list):
        return [move_to_device(v, device, non_blocking) for v in batch]
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor found depth-first in nested tuples / lists / dicts, or ``None``."""
    if isinstance(batch, torch.Tensor):
        return batch
    values: Iterable[Any]
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (tuple, list)):
        values = batch
    else:
        return None
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None
