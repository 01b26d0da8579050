"""The state every rank holds a replica of, made the same on all of them: :func:`sync_buffers`.

Each rank's forward passes update its own copy of a model's buffers (BatchNorm's running
statistics) from its own share of the batch. DDP broadcasts rank 0's buffers at the start of each
forward (``broadcast_buffers``), so after a step the ranks' copies differ by their last batch;
FSDP2 shards parameters only and never syncs buffers, so there they drift apart for the whole run.
A checkpoint holds one copy: the chief's, for a replicated model; under FSDP2 the copy of whichever
rank DCP picks for a replicated tensor. So the trainer and the evaluator call :func:`sync_buffers`
before every save and every evaluation: every rank then holds rank 0's buffers, the checkpoint holds
them too, and the model evaluated in training is the model saved, whatever the number of ranks.

Rank 0's, not an average (timm's ``distribute_bn(reduce=True)``): rank 0's buffers are never
changed by a sync, so their values do not depend on when syncs happen. A save taken at an
unplanned step (a preemption) therefore changes nothing a later checkpoint holds, and a resumed run
stays bit-identical to an uninterrupted one; under DDP it is also what the next forward pass would
broadcast anyway. The other ranks' copies are overwritten before anything reads them.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from cadence.torch.runtime.distributed import current_coordinator

__all__ = ["broadcast_from_rank0", "replicated_buffers", "sync_buffers"]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # only where there are ranks (a costly import)

    return isinstance(t, DTensor)


def replicated_buffers(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s buffers that a checkpoint holds (those in its ``state_dict``; non-persistent ones
    are rebuilt, not saved), each once, but any that is a sharded ``DTensor``. ``model`` may be
    wrapped (DDP, ``torch.compile``) or sharded by FSDP2 (its buffers are plain tensors)."""
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in model.state_dict(keep_vars=True).values():
        if not isinstance(t, torch.Tensor) or id(t) in params or id(t) in seen or _is_dtensor(t):
            continue
        seen.add(id(t))
        out.append(t)
    return out


def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` into every rank's, in place: one broadcast per device, of all
    the tensors' bytes at once (any dtype), over the default process group (CPU tensors: over the
    coordinator's gloo group, which is the default one unless that is nccl). A collective: every
    rank passes the same tensors, in the same order. No-op without a process group of several
    ranks. Rank 0's tensors are only read."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    receiving = dist.get_rank() != 0
    with torch.no_grad():
        for device, on_device in by_device.items():
            # wider elements first: each tensor's bytes start at a multiple of its element size
            on_device.sort(key=lambda t: -t.element_size())
            flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in on_device])
            dist.broadcast(flat, src=0, group=_group(device))
            if not receiving:
                continue
            offset = 0
            for t in on_device:
                size = t.numel() * t.element_size()
                t.copy_(flat[offset:offset + size].view(t.dtype).view(t.shape))
                offset += size


def _group(device: torch.device) -> Any:
    """The process group that broadcasts tensors on ``device`` (None: the default one)."""
    if device.type != "cpu":
        return None
    coordinator = current_coordinator()
    return coordinator.group if coordinator is not None else None


def sync_buffers(model: nn.Module, *more: Iterable[torch.Tensor]) -> None:
    """Rank 0's buffers of ``model`` (:func:`replicated_buffers`), and rank 0's values of ``more``
    (e.g. an EMA's averages of those buffers), on every rank; a collective (see the module). No-op
    on a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    tensors = replicated_buffers(model)
    for extra in more:
        tensors.extend(extra)
    broadcast_from_rank0(tensors)
