"""Activation checkpointing (``trainer.activation_checkpointing``) of the units a Task names
(:meth:`Task.fsdp_units <cadence.torch.task.task.Task.fsdp_units>`): each chosen unit keeps only
its inputs in forward and runs its forward again in backward.

As ``trainer.compile`` does, the module itself is kept and only its ``forward`` is replaced, on the
instance, by a :class:`CheckpointedForward` (``torch.utils.checkpoint``, non-reentrant, the RNG
state preserved): ``state_dict`` keys stay the model's own (``checkpoint_wrapper`` would add a
``_checkpoint_wrapped_module.`` prefix), so a checkpoint of a run with it loads into a run without
it and back. Hooks (FSDP2's all-gathers, DDP's) run around the unit's call as before; a dropout in
the unit draws the same mask again in the recomputation, so the weights are bit-identical.

Applied after a Task's tensor parallelism and before ``torch.compile`` and DDP / FSDP2; a forward
without gradients (evaluation) runs the unit's forward as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cadence.errors import ConfigError

log = logging.getLogger(__name__)
__all__ = ["CheckpointedForward", "apply_activation_checkpointing", "checkpointed_forward", "chosen_units",
           "is_checkpointed"]


def checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s class's forward under ``torch.utils.checkpoint`` (non-reentrant, RNG state
    preserved); as it is without gradients."""
    forward = type(module).forward
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    return checkpoint(forward, module, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


class CheckpointedForward:
    """A unit's ``forward`` under activation checkpointing, set on the instance."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpointed_forward(self.module, *args, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` replaced ``module``'s own forward."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def chosen_units(model: nn.Module, units: Sequence[nn.Module], every: int) -> list[nn.Module]:
    """The innermost of ``units`` (those containing no other; never ``model`` itself), in
    ``model``'s module order, then every ``every``-th of them: the ``every``-th, ``2*every``-th, ..."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    ids = {id(u) for u in units if u is not model}
    inner = [m for m in model.modules() if id(m) in ids
             and not any(id(sub) in ids for sub in m.modules() if sub is not m)]
    return inner[every - 1::every]


def apply_activation_checkpointing(model: nn.Module, units: Sequence[nn.Module], every: int, *,
                                   declared_by: str = "fsdp_units") -> list[nn.Module]:
    """Checkpoint every ``every``-th of ``units`` (:func:`chosen_units`) in place; they are returned.
    :class:`~cadence.errors.ConfigError` when ``units`` names no submodule of ``model`` (``declared_by``
    names where the units came from)."""
    chosen = chosen_units(model, units, every)
    if not chosen:
        raise ConfigError(f"trainer.activation_checkpointing: {declared_by} names no unit of {type(model).__name__} to "
                          "checkpoint: name its blocks there, or set trainer.activation_checkpointing: none")
    for unit in chosen:
        unit.forward = CheckpointedForward(unit)
    kinds = ", ".join(sorted({type(u).__name__ for u in chosen}))
    log.info("activation checkpointing: %d unit(s) of %s (%s), every %d", len(chosen), type(model).__name__, kinds, every)
    return chosen
