"""A replica group's state as this rank holds it, for the peer rank of another group: each ``DTensor``
(FSDP2's, TP's, HSDP's parameters, their optimizer state) as its local shard, and back.

torchft pairs the ranks of equal group rank across groups (healing and the gradient average), and
groups of the same size and mesh cut every ``DTensor`` alike: the same group rank holds the same
shard in every group. So a rank sends its local tensors as they are (plain tensors: torchft's HTTP
transport pickles what it sends, and a ``DTensor`` would carry its device mesh), and the receiving
rank wraps each into a ``DTensor`` on its own mesh and placements -- no collective, no full tensor.
A model without ``DTensor`` (one process, DDP) passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["load_local_model", "load_local_optimizer", "local_tensors", "rebuild_dtensors"]


def local_tensors(state: Any) -> Any:
    """``state`` (tensors in nested dicts, lists and tuples) with each ``DTensor`` replaced by its
    local shard (the tensor itself, not a copy); every other value as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {k: local_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_tensors(v) for v in state)
    return state


def rebuild_dtensors(local: Any, like: Any) -> Any:
    """``local`` (what :func:`local_tensors` made of a state shaped as ``like``) with each tensor whose
    counterpart in ``like`` is a ``DTensor`` wrapped into a ``DTensor`` on that one's mesh, placements,
    global shape and stride (``ValueError`` when the local shapes differ: a peer cut otherwise);
    every other value as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor) and isinstance(local, torch.Tensor) and not isinstance(local, DTensor):
        own = like.to_local()
        if tuple(local.shape) != tuple(own.shape):
            raise ValueError(f"a peer's shard has shape {tuple(local.shape)}, this rank's {tuple(own.shape)} "
                             f"(of {tuple(like.shape)}): the groups' meshes differ")
        return DTensor.from_local(local.to(own.device, own.dtype), like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    if isinstance(local, Mapping):
        return {k: rebuild_dtensors(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in local.items()}
    if isinstance(local, (list, tuple)) and isinstance(like, (list, tuple)) and len(local) == len(like):
        return type(local)(rebuild_dtensors(v, w) for v, w in zip(local, like))
    return local


def load_local_model(module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load a peer rank's :func:`local_tensors` of ``module.state_dict()`` into ``module`` (strict)."""
    module.load_state_dict(rebuild_dtensors(dict(state), module.state_dict()))


def load_local_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a peer rank's :func:`local_tensors` of ``optimizer.state_dict()`` into ``optimizer``, which
    may hold no state yet (a fresh process): each state tensor, copied, of its ``DTensor`` parameter's
    local shape (Adam's moments) becomes a ``DTensor`` placed as that parameter; scalars (``step``) stay."""
    from torch.distributed.tensor import DTensor

    groups, saved_groups = optimizer.param_groups, list(state.get("param_groups", ()))
    params = {index: param for group, saved in zip(groups, saved_groups)
              for index, param in zip(saved["params"], group["params"])}
    rebuilt = {}
    for index, values in state.get("state", {}).items():
        # its own memory: the optimizer steps its state in place, and what a peer sent may be a
        # read-only buffer (load_state_dict keeps a tensor of the right dtype and device as it is)
        values = {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        param = params.get(index)
        if isinstance(param, DTensor):
            shape = tuple(param.to_local().shape)
            values = {name: rebuild_dtensors(v, param) if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == shape
                      else v for name, v in values.items()}
        rebuilt[index] = values
    optimizer.load_state_dict({**state, "state": rebuilt})
