"""Scalar summaries: TensorBoard event files plus ``metrics.jsonl``, side by side.

Each :class:`SummaryWriter` owns one directory of the model dir (``train/``, ``eval/``, ...).
Every :meth:`SummaryWriter.write` records the scalar metrics of one step twice:

* as a TensorBoard event (written with tensorboard's own ``EventFileWriter``; no TensorFlow or
  torch needed), so ``tensorboard --logdir MODEL_DIR`` shows them;
* as one JSON object per line in ``metrics.jsonl``: ``{"step": 200, "time": 1718000000.0,
  "loss": 0.12, ...}`` -- easy to read back with :func:`read_metrics`, ``jq`` or pandas.

:class:`SummaryManager` writes a run's whole output as Orbit's does: a top-level key whose value
is a mapping (one of several evaluation datasets, say) goes to a subdirectory of its own.

A logdir may be an fsspec URL (``s3://bucket/run/train``). Object stores cannot append, so there
the writer keeps ``metrics.jsonl``'s content in memory and uploads the whole object at each write
(one PUT; readers see the previous object or the new one, never a partial line), and the event
file is written to a local temp directory by the same ``EventFileWriter`` and uploaded whole at
each :meth:`SummaryWriter.flush` and at :meth:`SummaryWriter.close` (the controller flushes after
every summary). Why not tensorboard's own remote writing: its ``gfile`` picks, for ``s3://``, its
boto3-based S3 file system when boto3 is installed and fsspec otherwise -- two code paths with
their own endpoint settings (``S3_ENDPOINT``) -- while the upload goes through
:class:`~cadence.storage.Storage` like every other file of the model dir.

NaN and infinities are kept (JSON gets Python's ``NaN`` / ``Infinity`` / ``-Infinity``, which
:func:`read_metrics` reads back). A restarted run appends to the same ``metrics.jsonl``; a run
resumed from a checkpoint first drops what a killed run wrote past it
(:meth:`SummaryManager.resume_at`).

Nothing here imports tensorboard or numpy until it is needed.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import operator
import os
import shutil
import tempfile
import threading
import time
import warnings
from typing import IO, Any, Iterator
from collections.abc import Mapping

from cadence.storage import Storage, is_url, local_path

__all__ = ["METRICS_FILE", "SummaryManager", "SummaryWriter", "flatten_scalars", "json_value", "read_metrics", "to_scalar",
           "truncate_metrics"]

logger = logging.getLogger("cadence")

METRICS_FILE = "metrics.jsonl"
"""Name of the JSON-lines file written next to the event files."""

_RESERVED = ("step", "time")
_warned_reserved: set[str] = set()


# --------------------------------------------------------------------------------------------
# scalars


def to_scalar(value: Any) -> int | float | None:
    """``value`` as a Python ``int`` / ``float``, or ``None`` when it is not a scalar number.

    Accepts Python numbers (``bool`` becomes ``0`` / ``1``), NumPy scalars and 0-d arrays, and
    anything whose ``.item()`` returns a number (a one-element torch tensor, say).
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if item is None or not callable(item) or isinstance(value, (str, bytes, Mapping)):
        return None
    try:
        result = item()
    except Exception:  # a multi-element array or tensor: not a scalar
        return None
    if result is value or not isinstance(result, numbers.Real):
        return None
    return to_scalar(result)


def json_value(value: Any) -> Any:
    """A metric value for a JSON record: ``.item()`` of tensors/arrays taken, NaN/inf as strings
    (strict JSON has no NaN), anything else unchanged."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def flatten_scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, int | float]:
    """The scalar entries of ``metrics``, nested mappings flattened to ``a/b`` keys.

    Non-scalar values (strings, lists, multi-element arrays, ...) are left out.
    """
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_scalars(value, name))
            continue
        scalar = to_scalar(value)
        if scalar is not None:
            out[name] = scalar
    return out


# --------------------------------------------------------------------------------------------
# paths


def _split_url(path: str) -> tuple[str | None, str]:
    """``(protocol, path)``; protocol ``None`` for local paths (``file://`` is local too)."""
    local = local_path(path)
    return (None, local) if local is not None else (path.split("://", 1)[0], path)


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def _repair_tail(data: bytes) -> bytes:
    """Drop a partial last line left by a killed writer (keep it if it is complete JSON)."""
    if not data or data.endswith(b"\n"):
        return data
    head, _, tail = data.rpartition(b"\n")
    try:
        json.loads(tail)
    except ValueError:
        return head + b"\n" if head else b""
    return data + b"\n"


def _repair_local_tail(path: str) -> None:
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
        fixed = _repair_tail(tail)
        f.seek(pos)
        f.write(fixed)
        f.truncate(pos + len(fixed))


_EVENTS_PREFIX = "events.out.tfevents."


def _has_event_files(path: str) -> bool:
    try:
        return any(name.startswith(_EVENTS_PREFIX) for name in os.listdir(path))
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# writer


class SummaryWriter:
    """Writes scalar metrics to TensorBoard event files and ``metrics.jsonl`` in ``logdir``.

    The directory is created on the first :meth:`write`. ``logdir`` may be an fsspec URL: then
    ``metrics.jsonl`` is rewritten whole at each write and the event file, written locally, is
    uploaded at each :meth:`flush` and at :meth:`close` (see the module doc). Use as a context
    manager, or call :meth:`close`.

    ``purge_step`` (a run resumed from a checkpoint): when ``logdir`` holds event files already,
    the new event file starts with a ``SessionLog(status=START)`` event at that step, TensorBoard's
    restart marker -- its reader (``purge_orphaned_data``, on by default) then discards the
    earlier events at that step and later, which a killed run wrote past its last checkpoint
    (tensorboardX's ``purge_step``). It does not touch ``metrics.jsonl`` (see :func:`truncate_metrics`).
    """

    def __init__(self, logdir: str | os.PathLike[str], *, purge_step: int | None = None) -> None:
        self._logdir = os.fspath(logdir)
        self._purge_step = None if purge_step is None else operator.index(purge_step)
        self._protocol, self._path = _split_url(self._logdir)
        self._lock = threading.Lock()
        self._closed = False
        self._events: Any = None  # tensorboard EventFileWriter, created on first write
        self._jsonl: IO[bytes] | None = None  # local metrics.jsonl, opened on first write
        self._remote: Storage | None = None  # a remote (fsspec) logdir
        self._remote_data: bytearray | None = None  # the remote file's full content
        self._stage: str | None = None  # a remote logdir's event files, written here and uploaded
        self._uploaded: dict[str, int] = {}  # staged event file -> its size when last uploaded

    @property
    def logdir(self) -> str:
        """The directory (or URL) written to."""
        return self._logdir

    @property
    def metrics_path(self) -> str:
        """Path (or URL) of ``metrics.jsonl``."""
        return _join(self._logdir, METRICS_FILE)

    def write(self, step: int, metrics: Mapping[str, Any], *, events: bool = True, jsonl: bool = True) -> None:
        """Record the scalar entries of ``metrics`` at ``step`` (see :func:`flatten_scalars`) in
        the TensorBoard events (``events``) and ``metrics.jsonl`` (``jsonl``).

        A step with no scalar metric writes nothing.
        """
        step = operator.index(step)
        scalars = flatten_scalars(metrics)
        if not scalars:
            return
        wall_time = time.time()
        with self._lock:
            if self._closed:
                raise ValueError(f"SummaryWriter({self._logdir!r}) is closed")
            if jsonl:
                self._write_jsonl(step, wall_time, scalars)
            if events:
                self._write_events(step, wall_time, scalars)

    def flush(self) -> None:
        """Push everything written so far to disk (or to the remote store)."""
        with self._lock:
            if self._jsonl is not None:
                self._jsonl.flush()
            if self._events is not None:
                self._events.flush()
                self._upload_events()

    def close(self) -> None:
        """Flush and close the files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
            try:
                if self._events is not None:
                    self._events.close()
                    self._events = None
                    self._upload_events()
            finally:
                if self._stage is not None:
                    shutil.rmtree(self._stage, ignore_errors=True)
                    self._stage = None

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SummaryWriter({self._logdir!r})"

    # -- metrics.jsonl -------------------------------------------------------------------------

    def _write_jsonl(self, step: int, wall_time: float, scalars: Mapping[str, int | float]) -> None:
        record: dict[str, Any] = {"step": step, "time": wall_time}
        for key, value in scalars.items():
            if key in _RESERVED:
                if key not in _warned_reserved:
                    _warned_reserved.add(key)
                    warnings.warn(
                        f"metric {key!r} clashes with the {key!r} field of {METRICS_FILE}; "
                        "it is written to TensorBoard only",
                        stacklevel=3,
                    )
                continue
            record[key] = value
        line = (json.dumps(record, allow_nan=True) + "\n").encode("utf-8")
        if self._protocol is None:
            self._local_jsonl().write(line)
            self._jsonl.flush()  # type: ignore[union-attr]  # a killed run keeps its metrics
        else:
            self._append_remote(line)

    def _local_jsonl(self) -> IO[bytes]:
        if self._jsonl is None:
            os.makedirs(self._path, exist_ok=True)
            path = os.path.join(self._path, METRICS_FILE)
            _repair_local_tail(path)
            self._jsonl = open(path, "ab")  # noqa: SIM115 - closed by close()
        return self._jsonl

    def _remote_storage(self) -> Storage:
        if self._remote is None:
            self._remote = Storage(self._logdir)
            self._remote.makedirs(self._remote.root)
        return self._remote

    def _append_remote(self, line: bytes) -> None:
        """Object stores cannot append: keep the whole file and rewrite it on each write."""
        remote = self._remote_storage()
        if self._remote_data is None:
            existing = _read_bytes(self.metrics_path) or b""
            self._remote_data = bytearray(_repair_tail(existing))
        self._remote_data += line
        remote.write_bytes(remote.join(METRICS_FILE), bytes(self._remote_data))

    def _upload_events(self) -> None:
        """A remote logdir: upload each staged event file that grew since its last upload, whole."""
        if self._stage is None:
            return
        remote = self._remote_storage()
        for name in sorted(os.listdir(self._stage)):
            path = os.path.join(self._stage, name)
            size = os.path.getsize(path)
            if name.startswith(_EVENTS_PREFIX) and size != self._uploaded.get(name):
                with open(path, "rb") as f:
                    remote.write_bytes(remote.join(name), f.read())
                self._uploaded[name] = size

    # -- TensorBoard ---------------------------------------------------------------------------

    def _write_events(
        self, step: int, wall_time: float, scalars: Mapping[str, int | float]
    ) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._events is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            if self._protocol is None:
                restart = self._purge_step is not None and _has_event_files(self._path)
                self._events = EventFileWriter(self._path)
            else:  # written locally, uploaded by flush() and close()
                remote = self._remote_storage()
                restart = self._purge_step is not None and any(
                    name.startswith(_EVENTS_PREFIX) for name in remote.listdir(remote.root))
                self._stage = tempfile.mkdtemp(prefix="cadence-events-")
                self._events = EventFileWriter(self._stage)
            if restart:  # before any new event: the reader purges the steps >= purge_step seen so far
                start = SessionLog(status=SessionLog.START)
                self._events.add_event(Event(wall_time=wall_time, step=self._purge_step, session_log=start))
        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self._events.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))


class SummaryManager:
    """The summaries of one directory, written as Orbit's ``SummaryManager`` writes them.

    :meth:`write_summaries` takes a run's output, e.g. an evaluation over two datasets
    ``{"loss": 0.3, "ds1": {"accuracy": 0.9}, "ds2": {"accuracy": 0.8}}``: the flat entries go to
    TensorBoard events in ``summary_dir``, and each top-level key whose value is a mapping gets a
    subdirectory (``summary_dir/ds1/``) whose events hold its entries as tags (``accuracy``; deeper
    mappings as ``a/b`` tags), so TensorBoard draws the datasets as curves of one chart.
    ``summary_dir/metrics.jsonl`` records the whole output, nested keys as ``ds1/accuracy``.

    Args:
      summary_dir: a local path or fsspec URL (remote: ``metrics.jsonl`` only, see
        :class:`SummaryWriter`); ``None``: nothing is written.
      enabled: False writes nothing (e.g. on all but the chief of several ranks).

    Writers and directories are created on the first write that needs them; :meth:`close`
    closes them (a later write opens them again).
    """

    def __init__(self, summary_dir: str | os.PathLike[str] | None, *, enabled: bool = True) -> None:
        self.summary_dir = None if summary_dir is None else os.fspath(summary_dir)
        self.enabled = enabled and summary_dir is not None
        self._writers: dict[str, SummaryWriter] = {}
        self._purge_step: int | None = None  # set by resume_at()
        self._purged: set[str] = set()  # the relative paths whose writer was given the purge step

    def resume_at(self, step: int) -> None:
        """The run goes on from ``step`` (its restored checkpoint): drop what a killed run wrote past it.

        Now: the records of ``summary_dir/metrics.jsonl`` with a larger step (the file is replaced
        at once, see :func:`truncate_metrics`). Then: the first writer of each directory marks the
        restart in its new event file (``purge_step=step + 1``, see :class:`SummaryWriter`), so
        TensorBoard discards the old events past ``step`` too. Call it once, before the first write
        of the resumed run; later writers (after :meth:`close`) do not mark it again. No-op when
        disabled (e.g. on all but the chief).
        """
        if not self.enabled or self.summary_dir is None:
            return
        self.close()
        self._purge_step = operator.index(step) + 1
        self._purged.clear()
        dropped = truncate_metrics(self.summary_dir, step)
        if dropped:
            logger.info("%s: dropped %d record(s) past step %d, written before the restart",
                        _join(self.summary_dir, METRICS_FILE), dropped, step)

    def summary_writer(self, relative_path: str = "") -> SummaryWriter:
        """The writer of ``summary_dir/relative_path`` (``""``: the directory itself), created on
        first use. Raises ValueError for ``SummaryManager(None)``."""
        if self.summary_dir is None:
            raise ValueError("SummaryManager(None) has no directory to write to")
        if relative_path not in self._writers:
            logdir = _join(self.summary_dir, relative_path) if relative_path else self.summary_dir
            purge_step = None if relative_path in self._purged else self._purge_step
            self._purged.add(relative_path)
            self._writers[relative_path] = SummaryWriter(logdir, purge_step=purge_step)
        return self._writers[relative_path]

    def write_summaries(self, step: int, summary_dict: Mapping[str, Any]) -> None:
        """Write ``summary_dict`` at ``step``: see the class docstring. No-op when disabled."""
        if not self.enabled:
            return
        flat = {k: v for k, v in summary_dict.items() if not isinstance(v, Mapping)}
        root = self.summary_writer()
        root.write(step, summary_dict, events=False)
        root.write(step, flat, jsonl=False)
        for key, value in summary_dict.items():
            if isinstance(value, Mapping):
                self.summary_writer(str(key)).write(step, value, jsonl=False)

    def recorded(self, step: int) -> dict[str, Any]:
        """The metrics last recorded at ``step`` in ``summary_dir/metrics.jsonl`` (nested keys
        flattened, as written there; without ``step`` and ``time``); ``{}`` when none is."""
        if self.summary_dir is None:
            return {}
        records = [r for r in read_metrics(self.summary_dir) if r.get("step") == step]
        return {k: v for k, v in records[-1].items() if k not in _RESERVED} if records else {}

    def flush(self) -> None:
        """Push what every writer of this manager has written to disk (or the remote store)."""
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer. Idempotent; a later write opens new ones."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def __repr__(self) -> str:
        return f"SummaryManager({self.summary_dir!r}, enabled={self.enabled})"


# --------------------------------------------------------------------------------------------
# reading


def _read_bytes(path: str) -> bytes | None:
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
    return _join(path, METRICS_FILE)


def read_metrics(logdir_or_file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (given the file or its directory), in file order.

    Returns ``[]`` when the file does not exist yet. A truncated last line (a writer killed
    mid-write) is skipped silently; any other unreadable line is skipped with a warning.
    """
    path = _metrics_file(logdir_or_file)
    data = _read_bytes(path)
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
    for _, line, record in _records(_repair_tail(data).split(b"\n")):
        found = record.get("step") if record is not None else None
        if isinstance(found, int) and not isinstance(found, bool) and found > step:
            dropped += 1
        else:
            kept.append(line + b"\n")
    content = b"".join(kept)
    if content != data:
        storage.write_atomic(storage.root, content)
    return dropped
