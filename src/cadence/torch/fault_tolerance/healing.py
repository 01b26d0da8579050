"""What a replica group hands a healing peer, and how the peer takes it: the model's and optimizer's
state, the LR scheduler's and grad scaler's, the EMA of the weights (``trainer.ema``: a healed group's
EMA is its peer's) and the global step -- the parts of a trainer that
:class:`~cadence.torch.loop.trainer_checkpoint.TrainerCheckpoint` saves, read from the same
:class:`~cadence.torch.loop.trainer_checkpoint.TrainerParts`.

Not handed over: the RNG state (the healed group re-seeds from ``(seed, its data shard, step)``, as
a rank without a saved state does on an elastic resume, so that the groups keep drawing different
dropout masks) and the peer's data position (the group reads its own shard: :class:`ReplicaSync` adds
the peer's table of every group's position, whose row of the healed group's shard it takes when that
is further on, :mod:`cadence.torch.fault_tolerance.positions`).

A group of several ranks: each rank hands over, and takes, its own part (torchft pairs the ranks of
equal group rank): a sharded model's ``DTensor`` parameters and optimizer state travel as their local
shards (:mod:`~cadence.torch.fault_tolerance.local_state`).
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.components.ema import ModelEMA
from cadence.torch.fault_tolerance.local_state import load_local_model, load_local_optimizer, local_tensors
from cadence.torch.loop.trainer_checkpoint import TrainerParts
from cadence.torch.runtime.rng import rank_seed, seed_everything

__all__ = ["healing_state", "load_healing_state"]


def healing_state(parts: TrainerParts, global_step: int) -> dict[str, Any]:
    """The state a healing peer loads: the tensors themselves. torchft's HTTP transport serves them
    until this group's commit vote, before which neither the parameters nor the optimizer state
    change; buffers that a forward pass updates (BatchNorm's statistics) may be sent as that step's
    forward pass left them."""
    return {
        "global_step": global_step,
        "model": local_tensors(unwrap_model(parts.model).state_dict()),
        "optimizer": local_tensors(parts.optimizer.state_dict()),
        "lr_scheduler": parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None,
        "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
        "ema": _ema_averages(parts.ema),
    }


def load_healing_state(parts: TrainerParts, state: dict[str, Any]) -> int:
    """Load a peer's :func:`healing_state` into ``parts``, re-seed the RNG for the peer's step;
    return that step."""
    step = int(state["global_step"])
    load_local_model(unwrap_model(parts.model), state["model"])
    load_local_optimizer(parts.optimizer, state["optimizer"])
    if parts.lr_scheduler is not None and state["lr_scheduler"] is not None:
        parts.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if parts.grad_scaler is not None and state["grad_scaler"] is not None:
        parts.grad_scaler.load_state_dict(state["grad_scaler"])
    if parts.ema is not None:
        _load_ema_averages(parts.ema, state.get("ema"))
    index, _ = parts.ctx.data_shard()
    seed_everything(rank_seed(parts.ctx.seed, index, step))
    return step


def _ema_averages(ema: ModelEMA | None) -> dict[str, torch.Tensor] | None:
    """The EMA's averages (its floating-point tensors, the live ones: they change only after the
    optimizer step, as the parameters do), by the model's keys; None without an EMA."""
    if ema is None:
        return None
    return {name: t for name, t in ema.averaged_state().items() if t.is_floating_point() or t.is_complex()}


def _load_ema_averages(ema: ModelEMA, averages: dict[str, torch.Tensor] | None) -> None:
    """Copy a peer's :func:`_ema_averages` into ``ema`` (a DTensor shard into the local shard); a peer
    without an EMA: the EMA restarts from the healed weights."""
    if averages is None:
        ema.reset()
        return
    if ema.fence is not None:
        ema.fence.wait()
    with torch.no_grad():
        for name, target in ema.averaged_state().items():
            if target.is_floating_point() or target.is_complex():  # the same keys: peer_check compared the configs
                local_tensors(target).copy_(local_tensors(averages[name]))
