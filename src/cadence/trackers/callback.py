"""Turning a run's events into tracker calls, off the training thread: :class:`TrackerCallback`."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from cadence import layout
from cadence.actions.best_checkpoint import read_best_record
from cadence.callbacks import Callback
from cadence.errors import one_line
from cadence.lifecycle import RunContext
from cadence.storage import Storage
from cadence.summaries.writer import flatten_scalars
from cadence.trackers.base import Tracker

logger = logging.getLogger("cadence.trackers")

__all__ = ["CLOSE_TIMEOUT", "MAX_QUEUED", "RECORDS_DIR", "TrackerCallback"]

RECORDS_DIR = "trackers"
"""``MODEL_DIR/trackers/``: ``<name>.json``, the run each tracker logs into (read by a resumed run
and by the sidecars, so all of them log into one run)."""
CLOSE_TIMEOUT = 120.0
"""Seconds :meth:`TrackerCallback.on_close` waits for a tracker to send what is queued."""
MAX_QUEUED = 10_000
"""Calls queued for one tracker before new ones are dropped (a tracker that cannot keep up)."""


class _Worker:
    """One tracker's thread: runs its calls in order; the first failure turns it off, with one
    warning, and what is queued after it is dropped."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.failed = False
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._dropping = False
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failed or self._closed:
            return
        if self._queue.qsize() >= MAX_QUEUED:
            if not self._dropping:
                self._dropping = True
                logger.warning("tracker %s cannot keep up (%d calls queued): dropping what it is given until "
                               "it catches up", self.tracker.name, MAX_QUEUED)
            return
        self._dropping = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"cadence-tracker-{self.tracker.name}",
                                            daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.failed:
                continue
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # never into training: one warning, then off
                self.failed = True
                logger.warning("tracker %s failed and logs nothing more from this process (training goes on): %s",
                               self.tracker.name, one_line(e, limit=300))
                logger.debug("tracker %s failure", self.tracker.name, exc_info=True)

    def close(self, timeout: float) -> None:
        """Queue the end and wait up to ``timeout`` s for the thread to get there."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("tracker %s is still busy after %.0f s: leaving it (what it had not sent is lost)",
                           self.tracker.name, timeout)


class TrackerCallback(Callback):
    """A :class:`~cadence.Callback` that logs the run into experiment trackers
    (:class:`~cadence.trackers.Tracker`: MLflow, W&B, your own), on the chief only.

    What it logs: ``params`` (the resolved config) once the run is open; each training summary's
    scalars (``Callback.on_train_logs``) as ``train/<key>``; each evaluation's as
    ``<eval_prefix>/<key>``, at its global step; after an evaluation, a new best checkpoint
    (``best/best.json``) as the metric ``best/<metric>`` at the best step and the summary values
    ``best/step``, ``best/metric``, ``best/value``; and, on close, the newest export under
    ``export_dir`` (``export/<name>/<step>/``) as an artifact, plus :meth:`log_artifact`'s.

    With ``model_dir``, each tracker's run is recorded in ``MODEL_DIR/trackers/<name>.json``
    (created once, atomically): a resumed run and every sidecar of the model dir continue that run.

    Each tracker runs on a thread of its own, so a slow or unreachable tracker never slows
    training; its first failure is logged as one warning and turns it off for the rest of the
    process. :meth:`on_close` waits up to ``close_timeout`` s for what is queued to be sent.
    """

    def __init__(self, trackers: Iterable[Tracker], *, model_dir: str | None = None,
                 params: Mapping[str, Any] | None = None, eval_prefix: str = "eval", train_prefix: str = "train",
                 export_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                 close_timeout: float = CLOSE_TIMEOUT) -> None:
        self.trackers = list(trackers)
        for i, tracker in enumerate(self.trackers):
            if not isinstance(tracker, Tracker):
                raise TypeError(f"trackers[{i}]: expected a cadence.trackers.Tracker, got {type(tracker).__name__}")
        self.model_dir = model_dir
        self.params = dict(params) if params is not None else None
        self.eval_prefix = eval_prefix
        self.train_prefix = train_prefix
        self.export_dir = export_dir
        self.storage_options = storage_options
        self.close_timeout = close_timeout
        self._workers = [_Worker(t) for t in self.trackers]
        self._chief = True
        self._started = False
        self._completed = False
        self._best: tuple[Any, ...] | None = None
        self._exported: str | None = None

    @property
    def failed(self) -> list[str]:
        """The names of the trackers that failed (and were turned off) in this process."""
        return [w.tracker.name for w in self._workers if w.failed]

    # -- events --------------------------------------------------------------------------------

    def attach(self, run: RunContext) -> None:
        self._chief = run.coordinator.is_chief

    def on_train_start(self) -> None:
        self._start()

    def on_train_logs(self, logs: dict[str, Any], step: int) -> None:
        self._submit_metrics(step, logs, self.train_prefix)

    def on_eval_end(self, metrics: dict[str, Any], step: int) -> None:
        self._submit_metrics(step, metrics, self.eval_prefix)
        if self._chief and self._workers and self.model_dir is not None:
            self._submit_best()

    def on_train_end(self) -> None:
        self._completed = True

    def on_close(self) -> None:
        if not self._chief or not self._started:
            return
        export = self._latest_export()
        if export is not None and export[0] != self._exported:
            self._exported = export[0]
            self.log_artifact(*export)
        for worker in self._workers:
            worker.submit(worker.tracker.close, self._completed)
        deadline = time.monotonic() + self.close_timeout
        for worker in self._workers:
            worker.close(max(0.0, deadline - time.monotonic()))

    def log_artifact(self, path: str, name: str) -> None:
        """Store the local file or directory ``path`` with the run as ``name`` (queued; chief only)."""
        if not self._chief:
            return
        self._start()
        for worker in self._workers:
            worker.submit(worker.tracker.log_artifact, path, name)

    # -- internals -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._started or not self._chief:
            return
        self._started = True
        for worker in self._workers:
            worker.submit(self._open, worker.tracker)

    def _submit_metrics(self, step: int, metrics: Mapping[str, Any], prefix: str) -> None:
        if not self._chief or not self._workers:
            return
        scalars = flatten_scalars(metrics)  # here: tensors are read on the training thread, once
        if not scalars:
            return
        self._start()
        for worker in self._workers:
            worker.submit(worker.tracker.log_metrics, step, scalars, prefix)

    def _record_file(self, tracker: Tracker) -> Storage | None:
        if self.model_dir is None:
            return None
        return Storage(layout.join(self.model_dir, RECORDS_DIR, f"{tracker.name}.json"), self.storage_options)

    def _open(self, tracker: Tracker) -> None:
        """(worker thread) Continue the model dir's run of ``tracker``, or begin it and record it."""
        storage = self._record_file(tracker)
        record = _read_json(storage) if storage is not None else None
        opened = tracker.start(record)
        if record is None and storage is not None:
            storage.makedirs(storage.root.rsplit("/", 1)[0])
            if not storage.create_exclusive(storage.root, (json.dumps(opened, indent=1) + "\n").encode()):
                winner = _read_json(storage)  # another process of the model dir recorded its run first
                tracker.discard()
                opened = tracker.start(winner)
        logger.info("tracker %s: logging into run %s", tracker.name, opened.get("run_id"))
        if self.params is not None:
            tracker.log_params(self.params)

    def _submit_best(self) -> None:
        """Log ``best/best.json`` (written by the eval actions, before ``on_eval_end``) when it
        changed since it was last logged."""
        try:
            record = read_best_record(layout.best_dir(self.model_dir or ""), self.storage_options)
        except (OSError, ValueError):  # unreadable now: the next evaluation looks again
            return
        if record is None or not isinstance(record.get("value"), (int, float)):
            return
        key = (record["step"], record["value"], record.get("metric"))
        if self._best == key:
            return
        self._best = key
        self._start()
        metric = str(record.get("metric", "metric"))
        summary = {"best/step": record["step"], "best/metric": metric, "best/value": record["value"]}
        for worker in self._workers:
            worker.submit(worker.tracker.log_metrics, record["step"], {metric: record["value"]}, "best")
            worker.submit(worker.tracker.log_summary, summary)

    def _latest_export(self) -> tuple[str, str] | None:
        """``(path, artifact name)`` of the newest ``<export_dir>/<step>/`` on a local disk,
        named ``export/<name>/<step>`` (None: no export, or not on a local disk)."""
        if self.export_dir is None:
            return None
        storage = Storage(self.export_dir, self.storage_options)
        if not storage.atomic_rename:  # artifacts are uploaded from local files
            return None
        steps = [int(name) for name in storage.listdir(storage.root) if name.isdigit()]
        if not steps:
            return None
        name = storage.root.rstrip("/").rsplit("/", 1)[-1]
        return storage.join(str(max(steps))), f"{layout.EXPORT}/{name}/{max(steps)}"


def _read_json(storage: Storage | None) -> dict[str, Any] | None:
    if storage is None:
        return None
    try:
        data = json.loads(storage.read_bytes(storage.root))
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None
