"""Re-saving a committed checkpoint elsewhere (e.g. into ``best/``) through the commit protocol."""

from __future__ import annotations

from typing import Any, Mapping

from cadence.checkpoint.files import STATE_NAME
from cadence.checkpoint.protocol import CheckpointReader, CheckpointWriter


class _Files:
    """Writes every file of ``reader`` except ``state.json``; records where they came from."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

    def save_checkpoint(self, writer: CheckpointWriter) -> dict[str, Any]:
        for name in self.reader.names():
            if name != STATE_NAME:
                writer.write(name, self.reader.view(name))
        return {"step": self.reader.step, "path": self.reader.path}


class JSONState:
    """A fixed JSON value saved under its name in ``state.json``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = state


def copy_objects(reader: CheckpointReader, state: Mapping[str, Any]) -> dict[str, object]:
    """Objects that, saved with :meth:`CheckpointManager.save`, reproduce a committed checkpoint:
    its files and its ``state.json`` entries under the same names, plus ``copied_from``
    (``{"step", "path"}`` of the source). ``state`` is the source's whole ``state.json``."""
    objects: dict[str, object] = {name: JSONState(value) for name, value in state["state"].items()}
    objects["copied_from"] = _Files(reader)
    return objects
