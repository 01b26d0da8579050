"""Which kind a checkpoint is, from its file names alone: sharded (DCP) or plain (safetensors).

Kept apart from :mod:`cadence.torch.checkpoint_io.sharded` so that telling the kinds apart does not
import ``torch.distributed.checkpoint`` (and the sympy it pulls in, about 1.4 s of CPU per process):
a run that never reads or writes a sharded checkpoint never imports it."""

from __future__ import annotations

__all__ = ["METADATA_FILE", "is_sharded_checkpoint"]

METADATA_FILE = ".metadata"
"""DCP's index file: its presence in a checkpoint's manifest makes the checkpoint sharded."""


def is_sharded_checkpoint(names: list[str]) -> bool:
    """Whether a checkpoint whose files are ``names`` holds DCP shards."""
    return METADATA_FILE in names
