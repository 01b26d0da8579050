"""Scalar summaries: TensorBoard event files plus ``metrics.jsonl``, side by side.

Each :class:`SummaryWriter` owns one directory of the model dir (``train/``, ``eval/``, ...).
Every :meth:`SummaryWriter.write` records the scalar metrics of one step twice:

* as a TensorBoard event (written with tensorboard's own ``EventFileWriter``; no TensorFlow or
  torch needed), so ``tensorboard --logdir MODEL_DIR`` shows them;
* as one JSON object per line in ``metrics.jsonl`` (:mod:`cadence.summaries.metrics_file`):
  ``{"step": 200, "time": 1718000000.0, "loss": 0.12, ...}`` -- easy to read back with
  :func:`~cadence.summaries.metrics_file.read_metrics`, ``jq`` or pandas.

:class:`~cadence.summaries.manager.SummaryManager` writes a run's whole output as Orbit's does: a top-level key whose value
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

NaN and infinities are kept. A restarted run appends to the same ``metrics.jsonl``; a run
resumed from a checkpoint first drops what a killed run wrote past it
(:meth:`~cadence.summaries.manager.SummaryManager.resume_at`).

Nothing here imports tensorboard or numpy until it is needed.
"""

from __future__ import annotations

import json
import operator
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from typing import IO, Any

from cadence.storage import Storage, local_path
from cadence.summaries.metrics_file import METRICS_FILE, RESERVED, join, read_bytes, repair_local_tail, repair_tail
from cadence.summaries.scalars import flatten_scalars

__all__ = ["SummaryWriter"]

_warned_reserved: set[str] = set()


def _split_url(path: str) -> tuple[str | None, str]:
    """``(protocol, path)``; protocol ``None`` for local paths (``file://`` is local too)."""
    local = local_path(path)
    return (None, local) if local is not None else (path.split("://", 1)[0], path)


_EVENTS_PREFIX = "events.out.tfevents."


_LAST_EVENT_FILE_SECOND: dict[str, int] = {}
_EVENT_FILE_LOCK = threading.Lock()


def _new_event_file_writer(directory: str, logdir: str) -> Any:
    """tensorboard's ``EventFileWriter`` on a new file of ``directory`` (``logdir``'s, or the local folder its
    file is written in before the upload), never in the same wall-clock second as the previous one this process
    opened for ``logdir``.

    Its file name is ``events.out.tfevents.<second>.<host>.<pid>.<n>`` with ``n`` a per-process counter that is
    not zero-padded, and readers (TensorBoard's, cadence's) take a run's files in name order: two files of one
    logdir opened in one second by one process sort wrong once ``n`` passes a power of ten (``.9`` after
    ``.10``), so a resumed run's purge marker could be read before the events it purges. Waiting for the next
    second (only a process that closes and reopens a writer of the same logdir within one second does) keeps
    name order the order of creation."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    with _EVENT_FILE_LOCK:
        last = _LAST_EVENT_FILE_SECOND.get(logdir, -1)
        now = time.time()
        if int(now) <= last:
            time.sleep(last + 1 - now)
        writer = EventFileWriter(directory)
        _LAST_EVENT_FILE_SECOND[logdir] = int(time.time())
    return writer


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
    (tensorboardX's ``purge_step``). It does not touch ``metrics.jsonl`` (see
    :func:`~cadence.summaries.metrics_file.truncate_metrics`).
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
        return join(self._logdir, METRICS_FILE)

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
            if key in RESERVED:
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
            repair_local_tail(path)
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
            existing = read_bytes(self.metrics_path) or b""
            self._remote_data = bytearray(repair_tail(existing))
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
            if self._protocol is None:
                restart = self._purge_step is not None and _has_event_files(self._path)
                self._events = _new_event_file_writer(self._path, self._path)
            else:  # written locally, uploaded by flush() and close()
                remote = self._remote_storage()
                restart = self._purge_step is not None and any(
                    name.startswith(_EVENTS_PREFIX) for name in remote.listdir(remote.root))
                self._stage = tempfile.mkdtemp(prefix="cadence-events-")
                self._events = _new_event_file_writer(self._stage, self._path)
            if restart:  # before any new event: the reader purges the steps >= purge_step seen so far
                start = SessionLog(status=SessionLog.START)
                self._events.add_event(Event(wall_time=wall_time, step=self._purge_step, session_log=start))
        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self._events.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

