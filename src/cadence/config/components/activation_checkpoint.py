"""``trainer.activation_checkpointing``: which units recompute their activations in backward
(:mod:`cadence.torch.parallel.activation_checkpoint` applies it)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from cadence.config.base import ConfigModel

__all__ = ["ACTIVATION_CHECKPOINTING_FORM", "ActivationCheckpointConfig", "activation_checkpointing_shorthand"]

ACTIVATION_CHECKPOINTING_FORM = "none, full, or a mapping {every: N}"


class ActivationCheckpointConfig(ConfigModel):
    """Activation checkpointing: every `every`-th unit `Task.fsdp_units` names (the innermost ones, in
    the model's order: the N-th, 2N-th, ...; `full`: all) keeps only its inputs in forward and runs
    its forward again in backward (`torch.utils.checkpoint`, non-reentrant, the RNG state preserved: a
    dropout draws the same mask again). Less activation memory for about one more forward of those units;
    the same weights, bit for bit, and the same checkpoint keys (a run with it and one without load each
    other's checkpoints). On one process, `ddp` and `fsdp` alike; applied before `compile` and sharding."""

    every: int = Field(
        default=1, ge=1, strict=True,
        description="Checkpoint every N-th unit (1: all of them, as `full`).",
    )


def activation_checkpointing_shorthand(value: Any) -> Any:
    """The short forms: ``none`` / ``false``: off (as null); ``full`` / ``true``: every unit."""
    if value is False or value == "none":
        return None
    if value is True or value == "full":
        return {}
    return value
