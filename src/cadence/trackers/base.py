"""The :class:`Tracker` interface (what an experiment tracker does for cadence), the helpers its
implementations share, and the check that an optional extra is installed."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any

from cadence.errors import ConfigError

__all__ = ["Tracker", "default_run_name", "flatten_params", "param_value", "require_extra"]


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


class Tracker:
    """An experiment tracker (MLflow, Weights & Biases, your own): where a run's params, metrics
    and artifacts go besides TensorBoard and ``metrics.jsonl``.

    Subclass it and implement the methods. A :class:`~cadence.trackers.TrackerCallback` calls
    them from a background thread of its own, one call at a time, in the order of the run's
    events, and only on the chief: an implementation needs no locking and may block (a slow
    server slows nothing but that thread). An exception from any method turns the tracker off for
    the rest of the process, with one warning; training never sees it.

    Life cycle: :meth:`start` (once), then any of :meth:`log_params`, :meth:`log_metrics`,
    :meth:`log_summary`, :meth:`log_artifact`, then :meth:`close` (once).
    """

    name: str = "tracker"
    """Names the tracker in warnings and its run record, ``MODEL_DIR/trackers/<name>.json``."""

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
