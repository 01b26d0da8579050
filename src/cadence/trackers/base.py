"""The :class:`Tracker` base class: an experiment tracker is a :class:`~cadence.Callback` that logs
the run's events off the training thread, on the chief only, into one run per model dir; the
helpers its implementations share, and the check that an optional extra is installed."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping
from typing import Any

from cadence import layout
from cadence.actions.best_checkpoint import read_best_record
from cadence.errors import ConfigError
from cadence.extensions import Callback, RunContext
from cadence.storage import Storage
from cadence.summaries.writer import flatten_scalars
from cadence.trackers.worker import TrackerThread

logger = logging.getLogger("cadence.trackers")

__all__ = ["CLOSE_TIMEOUT", "RECORDS_DIR", "Tracker", "default_run_name", "flatten_params", "param_value",
           "require_extra"]

RECORDS_DIR = "trackers"
"""``MODEL_DIR/trackers/``: ``<name>.json``, the run each tracker logs into (read by a resumed run
and by the sidecars, so all of them log into one run)."""
CLOSE_TIMEOUT = 120.0
"""Seconds :meth:`Tracker.on_close` waits for the tracker to send what is queued."""


def require_extra(module: str, extra: str, where: str) -> None:
    """ConfigError naming ``pip install 'cadence[<extra>]'`` when ``module`` cannot be imported.

    Looks for the module without importing it (cheap on every rank; the import itself happens
    where the tracker starts)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        found = False
    if not found:
        raise ConfigError(f"{where}: the {module} package is not installed: pip install 'cadence[{extra}]'")


def default_run_name(model_dir: str | None) -> str | None:
    """The model dir's last path component (``runs/digits`` -> ``digits``); None without one."""
    if not model_dir:
        return None
    return model_dir.rstrip("/").rsplit("/", 1)[-1] or None


def param_value(value: Any) -> str | int | float | bool | None:
    """A config value as one param: scalars unchanged, anything else (lists) as compact JSON."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, default=str, separators=(",", ":"))


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping (the resolved config) as ``{"trainer.train_steps": 600, ...}``; lists are
    kept whole (see :func:`param_value`), an empty mapping is kept as ``{}``."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, name))
        elif isinstance(value, Mapping):
            out[name] = "{}"
        else:
            out[name] = param_value(value)
    return out


class Tracker(Callback):
    """An experiment tracker (MLflow, Weights & Biases, your own): where a run's params, metrics
    and artifacts go besides TensorBoard and ``metrics.jsonl``. A :class:`~cadence.Callback`: pass
    it in the controller's callbacks (the config's ``loggers:`` section builds them,
    :func:`~cadence.trackers.build_trackers`).

    Subclass it and implement :meth:`start`, :meth:`log_metrics` and, as needed, the other
    ``log_*`` methods, :meth:`discard` and :meth:`close` (calling ``super().__init__(**settings)``
    with the keywords below). This class calls them from a background thread of the tracker's
    own, one call at a time, in the order of the run's events, and only on the chief: an
    implementation needs no locking and may block (a slow server slows nothing but that thread).
    An exception from any of them turns the tracker off for the rest of the process, with one
    warning; training never sees it. Life cycle: :meth:`start` (once), then any of
    :meth:`log_params`, :meth:`log_metrics`, :meth:`log_summary`, :meth:`log_artifact`, then
    :meth:`close` (once).

    What is logged: ``params`` once the run is open; each training summary's scalars
    (``on_train_logs``) as ``<train_prefix>/<key>``; each evaluation's as ``<eval_prefix>/<key>``,
    at its global step; after an evaluation, a new best checkpoint (``best/best.json``) as the
    metric ``best/<metric>`` at the best step and the summary values ``best/step``,
    ``best/metric``, ``best/value``; and, on close, the newest export under ``export_dir``
    (``export/<name>/<step>/``) as an artifact, plus :meth:`add_artifact`'s.

    Args:
      model_dir: with it, the tracker's run is recorded in ``MODEL_DIR/trackers/<name>.json``
        (created once, atomically): a resumed run and every sidecar of the model dir continue that
        run. ``None``: each process begins a run of its own.
      params: the run's parameters (the resolved config); ``None``: none logged.
      eval_prefix, train_prefix: the metrics' prefixes.
      export_dir: whose newest ``<step>/`` (on a local disk) is logged as an artifact on close.
      storage_options: fsspec options of the model dir's storage.
      close_timeout: seconds :meth:`on_close` waits for what is queued to be sent.
    """

    name: str = "tracker"
    """Names the tracker in warnings and its run record, ``MODEL_DIR/trackers/<name>.json``."""

    def __init__(self, *, model_dir: str | None = None, params: Mapping[str, Any] | None = None,
                 eval_prefix: str = "eval", train_prefix: str = "train", export_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None, close_timeout: float = CLOSE_TIMEOUT) -> None:
        self.model_dir = model_dir
        self.params = dict(params) if params is not None else None
        self.eval_prefix = eval_prefix
        self.train_prefix = train_prefix
        self.export_dir = export_dir
        self.storage_options = storage_options
        self.close_timeout = close_timeout
        self._thread = TrackerThread(self)
        self._chief = True
        self._started = False
        self._completed = False
        self._best_logged: tuple[Any, ...] | None = None
        self._exported: str | None = None

    # -- what an implementation does (on the tracker's thread) ----------------------------------

    def start(self, record: Mapping[str, Any] | None) -> dict[str, Any]:
        """Begin a new run (``record`` None) or continue the one ``record`` describes (what an
        earlier :meth:`start` returned, read back from the model dir: a resumed run or a sidecar
        of the same model dir). Returns the record of the run now open: JSON data with at least
        ``run_id``."""
        raise NotImplementedError

    def discard(self) -> None:
        """Drop the run :meth:`start` just began: another process of the same model dir recorded
        its run first, and :meth:`start` is called again with that run's record."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's parameters: the resolved config, as a nested mapping (:func:`flatten_params`
        gives the dotted form, ``trainer.train_steps``)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        """Scalar metrics at global step ``step``, each named ``<prefix>/<key>`` (``train/loss``,
        ``eval/accuracy``); keys may hold ``/`` already (nested metrics)."""
        raise NotImplementedError

    def log_summary(self, values: Mapping[str, Any]) -> None:
        """Values that describe the run as a whole (the best checkpoint's ``best/step``,
        ``best/metric``, ``best/value``): MLflow tags, a W&B run summary."""

    def log_artifact(self, path: str, name: str) -> None:
        """A local file or directory (the final export), stored with the run under ``name``
        (``export/final/600``)."""

    def close(self, completed: bool) -> None:
        """End this process's use of the run. ``completed``: training ended normally (the run
        may be marked finished); False after an error, or in a sidecar, leaves it as it is."""

    # -- the run's events (on the training thread) ----------------------------------------------

    @property
    def failed(self) -> bool:
        """Whether the tracker failed (and was turned off) in this process."""
        return self._thread.failed

    def add_artifact(self, path: str, name: str) -> None:
        """Store the local file or directory ``path`` with the run as ``name`` (queued; chief only)."""
        if not self._chief:
            return
        self._queue_start()
        self._thread.submit(self.log_artifact, path, name)

    def attach(self, run: RunContext) -> None:
        self._chief = run.coordinator.is_chief

    def on_train_start(self, run: RunContext) -> None:
        self._queue_start()

    def on_train_logs(self, run: RunContext, logs: dict[str, Any], step: int) -> None:
        self._queue_metrics(step, logs, self.train_prefix)

    def on_eval_end(self, run: RunContext, metrics: dict[str, Any], step: int) -> None:
        self._queue_metrics(step, metrics, self.eval_prefix)
        if self._chief and self.model_dir is not None:
            self._queue_best()

    def on_train_end(self, run: RunContext) -> None:
        self._completed = True

    def on_close(self, run: RunContext) -> None:
        if not self._chief or not self._started:
            return
        export = self._latest_export()
        if export is not None and export[0] != self._exported:
            self._exported = export[0]
            self.add_artifact(*export)
        self._thread.submit(self.close, self._completed)
        self._thread.close(self.close_timeout)

    # -- internals -----------------------------------------------------------------------------

    def _queue_start(self) -> None:
        if self._started or not self._chief:
            return
        self._started = True
        self._thread.submit(self._open_run)

    def _queue_metrics(self, step: int, metrics: Mapping[str, Any], prefix: str) -> None:
        if not self._chief:
            return
        scalars = flatten_scalars(metrics)  # here: tensors are read on the training thread, once
        if not scalars:
            return
        self._queue_start()
        self._thread.submit(self.log_metrics, step, scalars, prefix)

    def _record_file(self) -> Storage | None:
        if self.model_dir is None:
            return None
        return Storage(layout.join(self.model_dir, RECORDS_DIR, f"{self.name}.json"), self.storage_options)

    def _open_run(self) -> None:
        """(the tracker's thread) Continue the model dir's run, or begin it and record it."""
        storage = self._record_file()
        record = _read_json(storage) if storage is not None else None
        opened = self.start(record)
        if record is None and storage is not None:
            storage.makedirs(storage.root.rsplit("/", 1)[0])
            if not storage.create_exclusive(storage.root, (json.dumps(opened, indent=1) + "\n").encode()):
                winner = _read_json(storage)  # another process of the model dir recorded its run first
                self.discard()
                opened = self.start(winner)
        logger.info("tracker %s: logging into run %s", self.name, opened.get("run_id"))
        if self.params is not None:
            self.log_params(self.params)

    def _queue_best(self) -> None:
        """Log ``best/best.json`` (written by the eval actions, before ``on_eval_end``) when it
        changed since it was last logged."""
        try:
            record = read_best_record(layout.best_dir(self.model_dir or ""), self.storage_options)
        except (OSError, ValueError):  # unreadable now: the next evaluation looks again
            return
        if record is None or not isinstance(record.get("value"), (int, float)):
            return
        key = (record["step"], record["value"], record.get("metric"))
        if self._best_logged == key:
            return
        self._best_logged = key
        self._queue_start()
        metric = str(record.get("metric", "metric"))
        self._thread.submit(self.log_metrics, record["step"], {metric: record["value"]}, "best")
        self._thread.submit(self.log_summary,
                            {"best/step": record["step"], "best/metric": metric, "best/value": record["value"]})

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
