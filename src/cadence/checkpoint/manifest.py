"""``MANIFEST.json``: the list of a checkpoint's files with their sizes and checksums.

A checkpoint exists only when its manifest exists and its files match it. The manifest looks like
``{"format": "cadence-checkpoint", "version": 2, "step": N, "time": unix_seconds,
"files": {name: {"size": int, ALGORITHM: hex}}}``, one algorithm per file, named by its key
(:mod:`cadence.checkpoint.checksum`: ``crc32c`` by default, ``xxh3_128`` or ``sha256``). A sharded
checkpoint (files written by every rank) has version 3: each file written by a rank other than
the chief's own objects carries ``"rank": r``, the rank that wrote it -- a collective restore
verifies each such file on one rank only (see :func:`verify_all`). Version 1 manifests
(``sha256`` only) and version 2 keep verifying. Checksums are computed while files are written
(:class:`HashingStream`) and checked while they are read (:func:`read_verified`), one pass each.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
import json
import posixpath
import time
from typing import IO, Any, Callable, Mapping

from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint.background import Worker
from cadence.storage import Storage
from cadence.errors import CorruptCheckpointError

MANIFEST_NAME = "MANIFEST.json"
FORMAT = "cadence-checkpoint"
VERSION = 3
"""The newest version this cadence writes (3 for sharded checkpoints, 2 for the others, which
older versions of cadence read); it reads :data:`READ_VERSIONS`."""
READ_VERSIONS = (1, 2, 3)  # 1: every file's checksum is "sha256"; 3: files may name their "rank"
RANK_KEY = "rank"


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a checkpoint file name, or None when it can.

    A file name is a plain name: a non-empty string without ``/``, ``\\`` or NUL, not ``.`` /
    ``..``, and not ``MANIFEST.json``.
    """
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is not a non-empty string"
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        return f"file name {name!r} is not a plain name"
    if name == MANIFEST_NAME:
        return f"file name {name!r} is reserved"
    return None


_CHUNK = 8 << 20
_HASHER = Worker("cadence-checksum")  # checksums large writes chunk by chunk beside the writes


class HashingStream(io.RawIOBase):
    """A write-only binary stream that forwards to ``raw`` and checksums (``algorithm``, see
    :mod:`cadence.checkpoint.checksum`) and counts what it writes.

    The first ``OSError`` raised by ``raw`` is kept in :attr:`write_error` (a library writing
    through this stream may replace it by its own error, or swallow it):
    :meth:`raise_write_error` raises it again.
    """

    def __init__(self, raw: IO[bytes], algorithm: str = checksum_lib.DEFAULT_ALGORITHM) -> None:
        super().__init__()
        self._raw = raw
        self._checksum = checksum_lib.new(algorithm)
        self.size = 0
        self.write_error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # bytes-like
        if self.closed:
            raise ValueError("write to a closed checkpoint file")
        view = memoryview(data).cast("B")
        if view.nbytes <= _CHUNK:
            self._forward(self._raw.write, view)
            self._checksum.update(view)
        else:
            # Large buffers: checksum each chunk on a helper thread (the checksums release the
            # GIL) while the same chunk is written, so the checksum costs (almost) nothing beside the write.
            for start in range(0, view.nbytes, _CHUNK):
                chunk = view[start:start + _CHUNK]
                hashed = _HASHER.submit(self._checksum.update, chunk)
                try:
                    self._forward(self._raw.write, chunk)
                finally:
                    hashed.result()
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.closed:
            self._forward(self._raw.flush)

    def raise_write_error(self) -> None:
        """Raise :attr:`write_error` if a write to ``raw`` failed; otherwise do nothing."""
        if self.write_error is not None:
            raise self.write_error

    def _forward(self, call: Callable[..., object], *args: Any) -> None:
        try:
            call(*args)
        except OSError as e:
            if self.write_error is None:
                self.write_error = e
            raise

    def hexdigest(self) -> str:
        return self._checksum.hexdigest()


def build(step: int, files: Mapping[str, tuple[int, str]], *, algorithm: str = checksum_lib.DEFAULT_ALGORITHM,
          now: float | None = None, ranks: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint ``step`` whose files are ``{name: (size, hex digest)}``, each
    digest of ``algorithm``; ``ranks``: ``{name: rank}`` of the files written by the ranks of a
    sharded save (version 3; none: version 2)."""
    ranks = ranks or {}
    entries: dict[str, dict[str, Any]] = {}
    for name, (size, digest) in files.items():
        entries[name] = {"size": size, algorithm: digest}
        if name in ranks:
            entries[name][RANK_KEY] = ranks[name]
    return {
        "format": FORMAT,
        "version": VERSION if ranks else 2,
        "step": step,
        "time": time.time() if now is None else now,
        "files": entries,
    }


def entry_checksum(entry: Mapping[str, Any]) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of a parsed manifest's file entry."""
    (algorithm,) = (key for key in entry if key not in ("size", RANK_KEY))
    return algorithm, entry[algorithm]


def encode(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode()


def parse(data: bytes, *, path: str, step: int) -> dict[str, Any]:
    """Decode and validate a manifest read from checkpoint ``path`` (whose step is ``step``).

    Raises :class:`CorruptCheckpointError` (naming ``path``) when it is not valid JSON, has the
    wrong format, version or step, or lists a file with a bad name, size or digest.
    """

    def corrupt(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(path, f"{MANIFEST_NAME}: {reason}")

    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(f"not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise corrupt(f"not a {FORMAT} manifest")
    version = manifest.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise corrupt(f"unsupported version {version!r} (this cadence reads {', '.join(map(str, READ_VERSIONS))})")
    if manifest.get("step") != step or isinstance(manifest.get("step"), bool):
        raise corrupt(f"step {manifest.get('step')!r} does not match the directory's step {step}")
    if not isinstance(manifest.get("time"), (int, float)):
        raise corrupt("missing or bad 'time'")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise corrupt("missing or bad 'files'")
    for name, entry in files.items():
        problem = name_problem(name)
        if problem:
            raise corrupt(problem)
        if not isinstance(entry, dict):
            raise corrupt(f"bad entry for {name!r}")
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise corrupt(f"bad size for {name!r}: {size!r}")
        if RANK_KEY in entry:
            rank = entry[RANK_KEY]
            if version < 3:
                raise corrupt(f"entry for {name!r} has a {RANK_KEY!r}, which version {version} does not have")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise corrupt(f"bad {RANK_KEY} for {name!r}: {rank!r}")
        algorithms = sorted(key for key in entry if key not in ("size", RANK_KEY))
        allowed = ("sha256",) if version == 1 else checksum_lib.ALGORITHMS
        if len(algorithms) != 1 or algorithms[0] not in allowed:
            raise corrupt(f"entry for {name!r} must have 'size' and one checksum of {', '.join(allowed)}; "
                          f"it has {sorted(entry)}")
        problem = checksum_lib.digest_problem(algorithms[0], entry[algorithms[0]])
        if problem:
            raise corrupt(f"{problem} for {name!r}")
    return manifest


def read(storage: Storage, directory: str, step: int) -> dict[str, Any]:
    """Read and validate the manifest of the checkpoint in ``directory`` (a storage path).

    Raises :class:`CorruptCheckpointError` when it is missing, unreadable or invalid, or when it or
    ``directory`` is a symbolic link (never followed, see :meth:`~cadence.storage.Storage.link_under`).
    """
    url = storage.url(directory)
    path = posixpath.join(directory, MANIFEST_NAME)
    _refuse_link(storage, path, url)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(url, f"{MANIFEST_NAME} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(url, f"{MANIFEST_NAME} is unreadable ({e})") from None
    return parse(data, path=url, step=step)


def read_verified(storage: Storage, directory: str, manifest: Mapping[str, Any], name: str) -> memoryview:
    """File ``name`` of the checkpoint in ``directory``, checked against ``manifest``: a
    read-only view of its bytes (memory-mapped on local disks, see
    :meth:`~cadence.storage.Storage.read_view`), checked once before it is returned.

    Looks at no more than one byte past the file's listed size. Raises
    :class:`CorruptCheckpointError` when the file is not listed, missing, unreadable, a symbolic
    link (or below one), or its size or checksum differs.
    """
    url = storage.url(directory)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CorruptCheckpointError(url, f"{name} is not listed in {MANIFEST_NAME}")
    path = posixpath.join(directory, name)
    _refuse_link(storage, path, url)
    try:
        algorithm, expected = entry_checksum(entry)
        data, digest = _read_hashed(storage, path, algorithm, entry["size"] + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(url, f"{name} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(url, f"{name} is unreadable ({e})") from None
    if len(data) != entry["size"]:
        has = f"{len(data)} bytes" if len(data) <= entry["size"] else "more bytes"
        raise CorruptCheckpointError(url, f"{name} has {has}, the manifest says {entry['size']} (truncated or changed)")
    if digest != expected:
        raise CorruptCheckpointError(url, f"{name} does not match its {algorithm} in the manifest")
    return data


def _refuse_link(storage: Storage, path: str, url: str) -> None:
    """Raise :class:`CorruptCheckpointError` when ``path`` or a directory above it (below the
    storage's root) is a symbolic link: a checkpoint is read from the model dir only, never
    through a link that may lead outside it."""
    link = storage.link_under(path)
    if link is not None:
        raise CorruptCheckpointError(url, f"{storage.url(link)} is a symbolic link (not followed out of the model dir)")


def _read_hashed(storage: Storage, path: str, algorithm: str, limit: int) -> tuple[memoryview, str]:
    """A view of the file's first ``limit`` bytes and their checksum, one pass over them (from
    the page cache when the file is there: no copy)."""
    data = storage.read_view(path, limit, follow_link=False)
    return data, checksum_lib.checksum_of(algorithm, data)


_PARALLEL_READS = 4


def verify_all(storage: Storage, directory: str, manifest: Mapping[str, Any],
               share: tuple[int, int] | None = None) -> dict[str, memoryview]:
    """Every file listed in ``manifest``, verified (see :func:`read_verified`): ``{name: view}``.

    ``share=(rank, world_size)``: of the files that name the rank that wrote them (a sharded
    checkpoint's shards), only those with ``rank % world_size == rank``; the other files all.
    Together, the ranks of a collective restore verify every file once (on the same number of
    ranks as saved it, each rank the shards it wrote).

    Files are read and checked on up to four threads at once (reads and checksums release the
    GIL); the first failure, in the manifest's order, is raised once all are done."""
    names = [name for name, entry in manifest["files"].items()
             if share is None or RANK_KEY not in entry or entry[RANK_KEY] % share[1] == share[0]]
    if len(names) < 2:
        return {name: read_verified(storage, directory, manifest, name) for name in names}
    with ThreadPoolExecutor(min(_PARALLEL_READS, len(names)), thread_name_prefix="cadence-read") as pool:
        futures = [pool.submit(read_verified, storage, directory, manifest, name) for name in names]
        return {name: future.result() for name, future in zip(names, futures)}


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """``{"time", "size", "files", "ranks"}`` of a validated manifest: its time, the total bytes and the
    number of its files, and how many ranks wrote them (more than one for a sharded checkpoint)."""
    files = manifest["files"]
    return {"time": manifest["time"], "size": sum(entry["size"] for entry in files.values()), "files": len(files),
            "ranks": len({entry["rank"] for entry in files.values() if "rank" in entry}) or 1}
