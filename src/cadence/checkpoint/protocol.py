"""What a checkpoint holds, seen from the objects saved in it.

A checkpoint is a directory of files plus ``state.json``. The :class:`CheckpointManager` saves a
mapping ``name -> object`` and each object contributes in one of two ways:

* **Checkpointable** (``save_checkpoint`` / ``load_checkpoint``): writes its own files through the
  :class:`CheckpointWriter` (e.g. ``model.safetensors``, ``optimizer.pt``) and returns a
  JSON-serialisable value stored under its name in ``state.json``.
* **Stateful** (:class:`cadence.extensions.Stateful`: ``state_dict`` / ``load_state_dict``
  returning / taking JSON-serialisable values): stored under its name in ``state.json`` --
  actions' state (best value, patience) uses this.

For asynchronous saves a Checkpointable may also have ``snapshot_checkpoint()``, returning an
object whose ``save_checkpoint(writer)`` writes what ``save_checkpoint`` would have written at the
time of the snapshot (e.g. with tensors copied to memory rather than serialised); without it the
files are captured in memory through a writer.

``state.json`` looks like ``{"step": 200, "time": ..., "cadence_version": "...", "state": {name: ...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any, ContextManager, Mapping, Protocol, runtime_checkable

JSON = Any


class CheckpointWriter(Protocol):
    """Handed to ``save_checkpoint``: writes files into the checkpoint being committed."""

    step: int

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole file; its size and checksum go into the manifest."""
        ...

    def open(self, name: str) -> ContextManager[IO[bytes]]:
        """A binary file to stream into (hashed while writing), e.g. for ``torch.save``."""
        ...

    def add_files(self, files: Mapping[str, tuple[int, str]], *, rank: int) -> None:
        """Record files that rank ``rank`` of a sharded save wrote into the checkpoint's
        directory itself (see :class:`ShardTarget`): ``{name: (size, hex checksum)}``, each
        checksum of the target's algorithm."""
        ...


class CheckpointReader(Protocol):
    """Handed to ``load_checkpoint``: reads the verified files of one committed checkpoint."""

    step: int
    path: str
    """The checkpoint's location (local path or fsspec URL): for messages, and for a library
    that reads the checkpoint's directory itself (torch.distributed.checkpoint), once the
    manager has verified it."""
    @property
    def storage_options(self) -> Mapping[str, Any]:
        """The fsspec options of the checkpoint's storage (credentials, endpoint), for such a library."""
        ...

    def names(self) -> list[str]:
        """File names listed in the manifest."""
        ...

    def read(self, name: str) -> bytes:
        """A file's bytes, already checked against the manifest's size and checksum."""
        ...

    def view(self, name: str) -> memoryview:
        """The same bytes without a copy: a read-only view (of the memory-mapped file, for a
        local checkpoint), to be used before ``load_checkpoint`` returns -- e.g. tensors viewing
        it, copied once into the live state."""
        ...


@dataclass(frozen=True)
class ShardTarget:
    """Where every rank of a sharded save writes its files: the directory of checkpoint ``step``
    being committed (its temp dir on local disks), created by the chief and the same on every
    rank. The files' checksums are of ``algorithm``; ``background``: the save is asynchronous
    (the files may be written after the save returns, before the chief's commit)."""

    step: int
    directory: str
    """A local path or an fsspec URL."""
    algorithm: str
    background: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class WritesShards(Protocol):
    """A trainer whose checkpoint is written by every rank (a sharded model's state).

    :meth:`write_shards` is a collective: every rank writes its files into the target's
    directory (after ``prepare_checkpoint``, before the chief's ``save_checkpoint``), and the
    chief's ``save_checkpoint`` adds every rank's files to the manifest
    (:meth:`CheckpointWriter.add_files`)."""

    @property
    def writes_shards(self) -> bool:
        """Whether this trainer's checkpoints are sharded (otherwise the chief writes them all)."""
        ...

    def write_shards(self, target: ShardTarget) -> None:
        """Collective: write this rank's files into ``target.directory``; with
        ``target.background``, from a background thread (the previous one waited for first)."""
        ...

    def wait_for_shards(self) -> None:
        """Wait for this rank's background shard write; raise its failure
        (:class:`~cadence.errors.CheckpointError`)."""
        ...


@runtime_checkable
class Savable(Protocol):
    """Writes its own files into a checkpoint and returns its JSON state (a snapshot is one)."""

    def save_checkpoint(self, writer: CheckpointWriter) -> JSON | None: ...


@runtime_checkable
class Restorable(Protocol):
    """Restores itself from a checkpoint (an evaluator that only reads checkpoints is one)."""

    def load_checkpoint(self, reader: CheckpointReader, state: JSON | None) -> None: ...


@runtime_checkable
class Checkpointable(Savable, Restorable, Protocol):
    """Writes its own files into a checkpoint and restores itself from them."""


@runtime_checkable
class Snapshottable(Protocol):
    """A Checkpointable that captures its checkpoint for an asynchronous save: the returned
    object's ``save_checkpoint(writer)`` writes, later, what ``save_checkpoint`` would have
    written at the time of the snapshot (e.g. tensors copied rather than serialised)."""

    def snapshot_checkpoint(self) -> Savable: ...
