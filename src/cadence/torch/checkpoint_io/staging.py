"""Copies of tensors for asynchronous saves: into the buffers of a previous copy when they fit (no
allocation), into pinned memory without blocking on CUDA (:func:`staged` says when they are done),
and of whole state trees (:func:`clone_tree`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Sequence

import torch

__all__ = ["PLAIN_LEAVES", "clone_tree", "copy_tensor", "copy_tensors", "staged"]

PLAIN_LEAVES = (str, int, float, bool, complex, bytes, type(None), torch.dtype, torch.device, torch.Size)
"""Values kept as they are (immutable) when a state tree is copied."""


def copy_tensor(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous CPU copy of ``t``, written into ``into`` when that is a contiguous CPU tensor of
    the same shape and dtype (no allocation), else into a new tensor.

    A CUDA tensor is staged into *pinned* memory with a non-blocking copy: the call returns while
    the device-to-host transfer runs on the current stream, so the copy must not be read before
    :func:`staged` says so (an asynchronous save's writer thread waits for it)."""
    source = t.detach()
    cuda = source.device.type == "cuda"
    if into is not None and _fits(into, t, cuda):  # (the first test narrows the type for mypy)
        return into.copy_(source, non_blocking=cuda)
    if cuda:
        pinned = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        return pinned.copy_(source, non_blocking=True)
    return source.to("cpu", copy=True).contiguous()


def _fits(into: Any, t: torch.Tensor, cuda: bool) -> bool:
    """Whether ``t`` can be copied into ``into``: a contiguous CPU tensor of its shape and dtype, not
    ``t`` itself, pinned when ``t`` is on CUDA."""
    return (isinstance(into, torch.Tensor) and into.device.type == "cpu" and into.shape == t.shape
            and into.dtype == t.dtype and into.is_contiguous() and into.data_ptr() != t.data_ptr()
            and (not cuda or into.is_pinned()))


def copy_tensors(sources: Sequence[torch.Tensor], into: Sequence[Any], *, cuda: bool,
                 fitted: bool = False) -> list[torch.Tensor]:
    """:func:`copy_tensor` of each of the plain (strided, not quantized) tensors ``sources``, into
    the tensor at its index in ``into`` when it fits (``fitted``: a previous copy of the same
    tensors, only their shapes and dtypes checked), as one call that gives up the GIL once for all
    the copies (``torch._foreach_copy_``). One by one, each copy gives the GIL up and takes it back
    at once, and a thread that wants it meanwhile (the training thread) waits for the interpreter's
    switch interval (5 ms) each time. ``cuda``: a source is on a CUDA device: then they are copied
    one by one with :func:`copy_tensor` (into pinned memory, without blocking)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None or cuda:  # CUDA: queued one by one on the side stream, as copy_tensor does (not measured on GPU)
        return [copy_tensor(t, i if isinstance(i, torch.Tensor) else None) for t, i in zip(sources, into)]
    fitted = fitted and len(into) == len(sources) and [(t.shape, t.dtype) for t in sources] == [
        (i.shape, i.dtype) for i in into]  # cheap: a source resized in place since is checked as usual
    targets = list(into) if fitted else [i if _fits(i, t, False) else torch.empty(t.shape, dtype=t.dtype)
                                         for t, i in zip(sources, into)]
    if targets:
        with torch.no_grad():
            foreach(targets, list(sources))
    return targets


def staged(devices: set[torch.device]) -> Any:
    """An event to wait on (``.synchronize()``) before reading copies that :func:`copy_tensor` made
    from CUDA tensors on ``devices``; None when there are none (CPU copies are done on return).
    Recorded on each device's current stream, after the copies were queued."""
    events = []
    for device in sorted((d for d in devices if d.type == "cuda"), key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return _Events(events) if events else None


class _Events:
    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def synchronize(self) -> None:
        for event in self._events:
            event.synchronize()


def clone_tree(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are copied to CPU (a snapshot of optimizer state): dicts,
    lists and tuples are rebuilt, tensors copied (into the tensor at the same place in ``reuse``,
    a previous copy no longer needed, when it fits: see :func:`copy_tensor`), anything else
    deep-copied."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        return copy_tensor(obj, reuse if isinstance(reuse, torch.Tensor) else None)
    if kind in (dict, OrderedDict):
        old = reuse if isinstance(reuse, dict) else {}
        return kind((k, clone_tree(v, old.get(k))) for k, v in obj.items())
    if kind in (list, tuple):
        previous = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return kind(clone_tree(v, r) for v, r in zip(obj, previous))
    if kind in PLAIN_LEAVES:
        return obj
    return copy.deepcopy(obj)
