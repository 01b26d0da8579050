"""How each object of a checkpoint contributes to it, by its declared protocol
(:mod:`cadence.checkpoint.protocol`): a :class:`Savable` (a :class:`Checkpointable`) writes files
and returns its JSON state, a :class:`Stateful` is its JSON state; for asynchronous saves a :class:`Snapshottable`
captures itself, the others are captured through a writer in memory."""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

from cadence.checkpoint.files import MemoryWriter, Snapshot
from cadence.checkpoint.protocol import (
    CheckpointReader,
    CheckpointWriter,
    Restorable,
    Savable,
    Snapshottable,
)
from cadence.extensions import Stateful

logger = logging.getLogger("cadence.checkpoint")

__all__ = ["load_object", "save_object", "snapshot_objects"]


def save_object(name: str, obj: object, writer: CheckpointWriter) -> Any:
    """Write ``obj``'s files through ``writer``; its JSON state (``state.json[name]``).

    Raises:
      TypeError: ``obj`` is neither Savable (Checkpointable) nor Stateful.
    """
    if isinstance(obj, Savable):
        return obj.save_checkpoint(writer)
    if isinstance(obj, Stateful):
        return obj.state_dict()
    raise TypeError(f"cannot checkpoint {name!r}: {type(obj).__name__} has neither save_checkpoint nor state_dict")


def load_object(name: str, obj: object, reader: CheckpointReader, saved: Mapping[str, Any]) -> None:
    """Restore ``obj`` from ``reader`` and its saved state ``saved[name]``; an object with no saved
    state is left as it is (a Restorable object is handed ``None`` and reads its files)."""
    if isinstance(obj, Restorable):
        obj.load_checkpoint(reader, saved.get(name))
    elif name in saved and isinstance(obj, Stateful):
        obj.load_state_dict(saved[name])
    else:
        logger.debug("checkpoint %s holds no state for %r; left as is", reader.path, name)


def snapshot_objects(step: int, objects: Mapping[str, object]) -> dict[str, object]:
    """Each object's checkpoint as of now, to commit later: its ``snapshot_checkpoint()`` when it
    is Snapshottable, else its files in memory and its state deep-copied."""
    snapshot: dict[str, object] = {}
    for name, obj in objects.items():
        if isinstance(obj, Snapshottable):
            snapshot[name] = obj.snapshot_checkpoint()
        else:
            memory = MemoryWriter(step)
            state = save_object(name, obj, memory)
            snapshot[name] = Snapshot(memory.files, copy.deepcopy(state), memory.added)
    return snapshot
