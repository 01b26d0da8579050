"""Gradient clipping by the norm of the whole gradient on any device mesh (``trainer.grad_clip_norm``).

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one tensor: it raises when the
gradients are plain tensors and ``DTensor`` s together (tensor parallelism alone: a layer the Task's
plan leaves out has plain parameters) or ``DTensor`` s on different meshes (FSDP2 over a TP model: a
parameter outside the plan lives on the data-parallel mesh, the others on ``(dp_shard, tp)``).
:func:`clip_grad_norm_` groups the gradients by mesh, takes each group's norm as a full (replicated)
tensor -- a sharded gradient's pieces summed over its shards, a replicated one counted once -- and
combines them (torchtitan's ``dist_utils.clip_grad_norm_`` with ``full_tensor()``), then scales every
gradient's local part by the one coefficient. On plain tensors it is torch's own function.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _is_dtensor(t: torch.Tensor) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor  # only where there are ranks (a costly import)

    return isinstance(t, DTensor)


def total_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of the concatenation of the full tensors of ``grads`` (plain tensors,
    and ``DTensor`` s on any meshes): a plain 0-d float32 tensor, bit for bit the same on every rank.
    A collective for ``DTensor`` grads (each mesh reduces its group's norm, then one scalar
    all-reduce over the default group): every rank calls it with the same parameters, in the same
    order."""
    groups: dict[tuple[str, str] | None, list[torch.Tensor]] = {}
    for g in grads:
        key = None
        if _is_dtensor(g):  # a mesh by its dimension names (the same on every rank), then its ranks
            dtensor: Any = g
            key = (str(dtensor.device_mesh.mesh_dim_names), str(dtensor.device_mesh.mesh.tolist()))
        groups.setdefault(key, []).append(g)
    norms = []
    # the meshes' reductions in the same order on every rank: by their dimension names
    for key in sorted(groups, key=lambda k: (k is not None, k or ())):
        norm: Any = torch.nn.utils.get_total_norm(groups[key], norm_type)
        if key is not None:
            norm = norm.full_tensor()  # the partial norms of the shards reduced over the mesh
        norms.append(norm.float())
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if any(key is not None for key in groups):
        # A mesh of several dimensions reduces dimension after dimension: the ranks' values may differ
        # in the last bit. One value for all (their maximum), so that every replica clips alike.
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    return total


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their global norm
    (:func:`total_grad_norm`, over every mesh dimension) is at most ``max_norm``; return that norm
    (before clipping), as ``torch.nn.utils.clip_grad_norm_`` does. Without ``DTensor`` gradients it
    is ``torch.nn.utils.clip_grad_norm_`` itself. A collective when there are ``DTensor`` gradients."""
    params = [p for p in parameters if p.grad is not None]
    grads: list[Any] = [p.grad for p in params]
    if not any(_is_dtensor(g) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    total = total_grad_norm(grads, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own coefficient
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if _is_dtensor(g) else g  # without autograd: the DTensor's own local tensor
            local.mul_(coef.to(local.device, local.dtype))
    return total
