"""What a replica group hands a healing peer, and how the peer takes it: the model's and optimizer's
state, the LR scheduler's and grad scaler's, and the global step -- the parts of a trainer that
:class:`~cadence.torch.loop.trainer_checkpoint.TrainerCheckpoint` saves, read from the same
:class:`~cadence.torch.loop.trainer_checkpoint.TrainerParts`.

Not handed over: the RNG state (the healed group re-seeds from ``(seed, its data shard, step)``, as
a rank without a saved state does on an elastic resume, so that the groups keep drawing different
dropout masks) and the data position (the group's own: it reads its own shard from where it was).
An EMA is not handed over either (this version): a healed group's EMA restarts from the healed weights.

A group of several ranks: each rank hands over, and takes, its own part (torchft pairs the ranks of
equal group rank): a sharded model's ``DTensor`` parameters and optimizer state travel as their local
shards (:mod:`~cadence.torch.fault_tolerance.local_state`).
"""

from __future__ import annotations

from typing import Any

from cadence.torch.checkpoint_io.state import unwrap_model
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
        parts.ema.reset()
    index, _ = parts.ctx.data_shard()
    seed_everything(rank_seed(parts.ctx.seed, index, step))
    return step
