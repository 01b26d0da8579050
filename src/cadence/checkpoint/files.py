"""The writer and reader handed to checkpointed objects (see :mod:`cadence.checkpoint.protocol`)."""

from __future__ import annotations

import contextlib
import posixpath
import threading
from typing import IO, Any, Callable, Iterator, Mapping, cast

from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint.background import Pending, Workers
from cadence.checkpoint.manifest import HashingStream, name_problem
from cadence.checkpoint.protocol import CheckpointWriter
from cadence.storage import Storage
from cadence.errors import CheckpointError

STATE_NAME = "state.json"

SYNCERS = Workers("cadence-fsync", 4)
"""fsync closed checkpoint files while the next ones are written, several at once (one journal
commit for all of them rather than one per file)."""


class DirectoryWriter:
    """Writes the files of checkpoint ``step`` into ``directory`` and records their size and
    checksum (``algorithm``: see :mod:`cadence.checkpoint.checksum`), computed as they are written.

    Implements :class:`~cadence.checkpoint.protocol.CheckpointWriter`. File names must be plain
    names (see :func:`~cadence.checkpoint.manifest.name_problem`), unique within the checkpoint, and
    not ``state.json`` / ``MANIFEST.json``: anything else raises ``ValueError``. After the save the
    writer is closed and refuses further files.

    Each file is fsynced on a helper thread once closed (:data:`SYNCERS`), while the next file is
    being written; :meth:`files` (or :meth:`wait_durable`) waits for those fsyncs, raising their
    errors, so that everything is durable before the checkpoint is committed.

    Several files may be written at once from several threads (each file from one thread).
    """

    def __init__(self, storage: Storage, directory: str, step: int,
                 algorithm: str = checksum_lib.DEFAULT_ALGORITHM) -> None:
        self.step = step
        self.algorithm = algorithm
        self._storage = storage
        self._directory = directory
        self._lock = threading.Lock()
        self._claimed: set[str] = set()
        self._files: dict[str, tuple[int, str]] = {}
        self._ranks: dict[str, int] = {}
        self._closed = False
        self._syncs: list[Pending] = []

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole file; its size and checksum go into the manifest."""
        with self.open(name) as f:
            f.write(data)

    def open(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary stream for file ``name``, hashed while written; the file counts once closed."""
        self._claim(name, reserved=(STATE_NAME,))
        return self._open(name)

    def add_files(self, files: Mapping[str, tuple[int, str]], *, rank: int) -> None:
        """Record files that rank ``rank`` of a sharded save wrote into this checkpoint's
        directory itself: ``{name: (size, hex checksum of this writer's algorithm)}``.

        A rank that is not an int >= 0, a size that is not one, or a malformed checksum raises
        ``ValueError`` before any file is recorded (the manifest could not list them: the
        checkpoint would never verify)."""
        files = dict(files)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"checkpoint {self.step}: a rank is an int >= 0, got {rank!r}")
        for name, (size, digest) in files.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"checkpoint {self.step}: bad size {size!r} for {name!r}")
            problem = checksum_lib.digest_problem(self.algorithm, digest)
            if problem:
                raise ValueError(f"checkpoint {self.step}: {problem} for {name!r}")
        for name, (size, digest) in files.items():
            self._claim(name, reserved=(STATE_NAME,))
            self._files[name] = (int(size), str(digest))
            self._ranks[name] = int(rank)

    def ranks(self) -> dict[str, int]:
        """``{name: rank}`` of the files recorded by :meth:`add_files`."""
        return dict(self._ranks)

    def write_state(self, data: bytes) -> None:
        """Write ``state.json`` (the manager's own file)."""
        self._claim(STATE_NAME, reserved=())
        with self._open(STATE_NAME) as f:
            f.write(data)

    def files(self) -> dict[str, tuple[int, str]]:
        """``{name: (size, hex checksum)}`` of the files written, in order, once durable; closes the writer.

        Raises :class:`CheckpointError` when a file was opened but never completed.
        """
        self._closed = True
        self.wait_durable()
        return self.written()

    def written(self) -> dict[str, tuple[int, str]]:
        """As :meth:`files`, but at once: their fsyncs may still be running (:meth:`wait_durable`)."""
        self._closed = True
        unfinished = sorted(self._claimed - self._files.keys())
        if unfinished:
            raise CheckpointError(f"checkpoint files {unfinished} were opened but not completed")
        return dict(self._files)

    def sync(self, path: str) -> None:
        """fsync ``path`` (a file of the checkpoint not written through this writer: the manifest's
        temp file) beside the files' fsyncs; :meth:`wait_durable` waits for it too."""
        self._syncs.append(SYNCERS.submit(self._storage.fsync_file, path))

    def wait_durable(self) -> None:
        """Wait for the fsyncs of the files written so far, raising the first error."""
        syncs, self._syncs = self._syncs, []
        for sync in syncs:
            sync.wait()
        for sync in syncs:
            sync.result()

    def _claim(self, name: str, *, reserved: tuple[str, ...]) -> None:
        if self._closed:
            raise CheckpointError(f"the writer of checkpoint {self.step} is closed; write files during save_checkpoint")
        problem = name_problem(name)
        if problem is None and name in reserved:
            problem = f"file name {name!r} is reserved"
        with self._lock:
            if problem is None and name in self._claimed:
                problem = f"file {name!r} is written twice"
            if not problem:
                self._claimed.add(name)
        if problem:
            raise ValueError(f"checkpoint {self.step}: {problem}")

    @contextlib.contextmanager
    def _open(self, name: str) -> Iterator[IO[bytes]]:
        path = posixpath.join(self._directory, name)
        with self._storage.open_write(path, fsync=False) as raw:
            stream = HashingStream(raw, self.algorithm)
            try:
                # A RawIOBase used as the binary file it is (typeshed's io classes are not typing.IO's).
                yield cast(IO[bytes], stream)
            except BaseException:
                stream.raise_write_error()  # the failed write itself, not what a library made of it
                raise
            stream.raise_write_error()  # a failed write that the code writing the file ignored
            stream.flush()
            stream.close()
        self.sync(path)
        self._files[name] = (stream.size, stream.hexdigest())


class VerifiedReader:
    """Hands out the files of one committed checkpoint, verified against its manifest up front.

    Implements :class:`~cadence.checkpoint.protocol.CheckpointReader`. ``files`` are the verified
    files; ``listed`` all the manifest's names, when a collective restore left some of them to
    other ranks to verify: ``fetch(name)`` reads (and verifies) one of those on demand.
    ``storage_options``: those of the checkpoint's storage, for a library that reads
    :attr:`path` itself (torch.distributed.checkpoint).
    """

    def __init__(self, step: int, path: str, files: Mapping[str, bytes | memoryview], *,
                 listed: list[str] | None = None, fetch: Callable[[str], memoryview] | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.step = step
        self.path = path
        self.storage_options = dict(storage_options or {})
        self._files = {name: memoryview(data) for name, data in files.items()}
        self._listed = sorted(set(listed or ()) | self._files.keys())
        self._fetch = fetch

    def names(self) -> list[str]:
        """File names listed in the manifest (``state.json`` included), sorted."""
        return list(self._listed)

    def read(self, name: str) -> bytes:
        """A file's verified bytes (a copy). Raises :class:`CheckpointError` when there is no such file."""
        return self.view(name).tobytes()

    def view(self, name: str) -> memoryview:
        """A file's verified bytes, read-only, not copied. Raises :class:`CheckpointError` when
        there is no such file."""
        view = self._files.get(name)
        if view is not None:
            return view
        if name in self._listed and self._fetch is not None:
            view = self._files[name] = self._fetch(name)
            return view
        raise CheckpointError(f"checkpoint {self.path} has no file {name!r}; it has {self.names()}")


class MemoryWriter:
    """A :class:`~cadence.checkpoint.protocol.CheckpointWriter` that keeps the files in memory:
    the foreground half of an asynchronous save (a snapshot, written to disk later)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.files: dict[str, bytes] = {}
        self.added: list[tuple[dict[str, tuple[int, str]], int]] = []

    def add_files(self, files: Mapping[str, tuple[int, str]], *, rank: int) -> None:
        self.added.append((dict(files), rank))

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self.files[name] = bytes(data)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        import io

        buffer = io.BytesIO()
        yield buffer
        self.files[name] = buffer.getvalue()


class Snapshot:
    """An object's checkpoint captured at one moment: its files (bytes) and its JSON state."""

    def __init__(self, files: Mapping[str, bytes], state: object,
                 added: list[tuple[dict[str, tuple[int, str]], int]] | None = None) -> None:
        self.files = dict(files)
        self.state = state
        self.added = list(added or [])

    def save_checkpoint(self, writer: CheckpointWriter) -> object:
        for name, data in self.files.items():
            writer.write(name, data)
        for files, rank in self.added:
            writer.add_files(files, rank=rank)
        return self.state
