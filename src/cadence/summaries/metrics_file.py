"""``metrics.jsonl``: one JSON object per line, ``{"step": 200, "time": 1718000000.0, "loss": 0.12, ...}``.

Written by :class:`~cadence.summaries.writer.SummaryWriter` next to its TensorBoard events; read
back by :func:`read_metrics` (or ``jq``, pandas). NaN and infinities are kept (Python's ``NaN`` /
``Infinity`` / ``-Infinity``, which :func:`read_metrics` reads back). A run resumed from a
checkpoint first drops what a killed run wrote past it (:func:`truncate_metrics`). A file or its
directory may be a local path or an fsspec URL.
"""

from __future__ import annotations

import json
import operator
import os
import warnings
from typing import Any, Iterator

from cadence.storage import Storage, is_url

__all__ = ["METRICS_FILE", "RESERVED", "read_metrics", "truncate_metrics"]

METRICS_FILE = "metrics.jsonl"
"""Name of the JSON-lines file written next to the event files."""

RESERVED = ("step", "time")
"""The fields of every record; a metric of that name is not written to the file."""


def join(base: str, name: str) -> str:
    """``base/name`` for a local path or a URL."""
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def repair_tail(data: bytes) -> bytes:
    """Drop a partial last line left by a killed writer (keep it if it is complete JSON)."""
    if not data or data.endswith(b"\n"):
        return data
    head, _, tail = data.rpartition(b"\n")
    try:
        json.loads(tail)
    except ValueError:
        return head + b"\n" if head else b""
    return data + b"\n"


def repair_local_tail(path: str) -> None:
    """Make a local ``metrics.jsonl`` end with a complete line before appending to it."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        # Read back until the previous newline: the partial line is usually short.
        chunk = 4096
        pos = size
        tail = b""
        while pos > 0 and b"\n" not in tail:
            start = max(0, pos - chunk)
            f.seek(start)
            tail = f.read(pos - start) + tail
            pos = start
        fixed = repair_tail(tail)
        f.seek(pos)
        f.write(fixed)
        f.truncate(pos + len(fixed))


def read_bytes(path: str) -> bytes | None:
    """The content of the file at ``path`` (a local path or URL); None when it does not exist."""
    storage = Storage(path)
    try:
        return storage.read_bytes(storage.root)
    except FileNotFoundError:
        return None


def _metrics_file(logdir_or_file: str | os.PathLike[str]) -> str:
    path = os.fspath(logdir_or_file)
    if path.endswith(".jsonl"):
        storage = Storage(path)
        if not storage.isdir(storage.root):
            return path
    return join(path, METRICS_FILE)


def read_metrics(logdir_or_file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (given the file or its directory), in file order.

    Returns ``[]`` when the file does not exist yet. A truncated last line (a writer killed
    mid-write) is skipped silently; any other unreadable line is skipped with a warning.
    """
    path = _metrics_file(logdir_or_file)
    data = read_bytes(path)
    if data is None:
        return []
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict[str, Any]] = []
    for i, _, record in _records(lines):
        if record is not None:
            records.append(record)
        elif i != last:
            warnings.warn(f"{path}: line {i + 1} is not a JSON object; skipped", stacklevel=2)
    return records


def _records(lines: list[bytes]) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """``(index, line, record)`` for each non-blank line; ``record`` None when the line is not a
    JSON object (a partial line, or garbage)."""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            record = None
        yield i, line, record if isinstance(record, dict) else None


def truncate_metrics(logdir_or_file: str | os.PathLike[str], step: int) -> int:
    """Drop the records past ``step`` from a ``metrics.jsonl`` (given the file or its directory);
    how many were dropped.

    For a run resumed at ``step``: what a killed run wrote after its last checkpoint is written
    again. The other lines are kept byte for byte (an unreadable one too, but for a partial last
    line, which goes); the file is replaced all at once (temp file and rename on local disks,
    one write elsewhere: :meth:`~cadence.storage.Storage.write_atomic`), and only when something
    changes. A missing file is left missing.
    """
    step = operator.index(step)
    storage = Storage(_metrics_file(logdir_or_file))
    try:
        data = storage.read_bytes(storage.root)
    except FileNotFoundError:
        return 0
    kept: list[bytes] = []
    dropped = 0
    for _, line, record in _records(repair_tail(data).split(b"\n")):
        found = record.get("step") if record is not None else None
        if isinstance(found, int) and not isinstance(found, bool) and found > step:
            dropped += 1
        else:
            kept.append(line + b"\n")
    content = b"".join(kept)
    if content != data:
        storage.write_atomic(storage.root, content)
    return dropped
