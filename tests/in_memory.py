"""In-memory checkpoint files for the tests (the CheckpointWriter / CheckpointReader protocol):
:class:`MemReader` reads what a ``MemoryWriter`` captured; :func:`save` checkpoints a trainer into memory."""

from __future__ import annotations

import json
from typing import Any

from cadence.checkpoint.files import MemoryWriter


class MemReader:
    def __init__(self, files: dict[str, bytes], step: int, path: str = "mem://ckpt") -> None:
        self.files, self.step, self.path = dict(files), step, path
        self.storage_options: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def read(self, name: str) -> bytes:
        return self.files[name]

    def view(self, name: str) -> memoryview:
        return memoryview(self.files[name])


def save(trainer: Any) -> tuple[MemReader, Any]:
    """``trainer.save_checkpoint`` into memory: the reader of its files and its state as state.json would hold it."""
    writer = MemoryWriter(trainer.global_step)
    state = json.loads(json.dumps(trainer.save_checkpoint(writer)))  # as state.json would hold it
    return MemReader(writer.files, writer.step, f"mem://ckpt-{writer.step}"), state
