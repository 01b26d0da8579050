"""Looking up one metric in an action's output: :func:`get_metric`."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

from cadence.errors import CadenceError, ConfigError

logger = logging.getLogger("cadence")

MetricFn = Callable[[Mapping[str, Any]], Any]
Metric = str | MetricFn

__all__ = ["Metric", "MetricFn", "MetricNotFoundError", "check_metric", "get_metric", "is_better", "metric_name",
           "same_metric"]


class MetricNotFoundError(CadenceError, KeyError):
    """The metric an action looks for is not in the output; the message lists the keys there are."""

    def __init__(self, metric: str, available: list[str]) -> None:
        message = (
            f"metric {metric!r} not found in the output; available keys: "
            + (", ".join(repr(k) for k in available) if available else "(none: the output is empty)")
        )
        super().__init__(message)
        self.metric = metric
        self.available = available
        self.message = message

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.message


def _flat_keys(output: Mapping[Any, Any], prefix: str = "") -> list[str]:
    """Every metric of ``output``: its keys, nested mappings (named splits) flattened to their
    ``a/b`` keys (as summaries write them)."""
    keys: list[str] = []
    for key, value in output.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            keys.extend(_flat_keys(value, name + "/"))
        else:
            keys.append(name)
    return sorted(keys)


def _find(node: Mapping[Any, Any], path: str) -> tuple[bool, Any]:
    """``(True, value)`` of ``path`` in ``node``: the key itself, else a key ``head`` (the longest
    first) of a nested mapping and the rest of the path in it (``"raw/val/loss"`` in
    ``{"raw/val": {"loss": ...}}``); ``(False, None)`` when no such key is there."""
    if path in node:
        return True, node[path]
    parts = path.split("/")
    for i in range(len(parts) - 1, 0, -1):
        head = "/".join(parts[:i])
        if isinstance(node.get(head), Mapping):
            found, value = _find(node[head], "/".join(parts[i:]))
            if found:
                return True, value
    return False, None


def _lookup(output: Mapping[str, Any], metric: str) -> Any:
    found, value = _find(output, metric)
    if not found:
        raise MetricNotFoundError(metric, _flat_keys(output))
    return value


def get_metric(output: Mapping[str, Any], metric: Metric) -> float:
    """The value of ``metric`` in ``output``, as a Python float.

    Args:
      output: a train loop's logs or an evaluation's metrics.
      metric: a key (``"accuracy"``); a nested key ``"a/b"``, which looks up
        ``output["a"]["b"]`` (a named split's metric, ``"val/loss"``) -- unless ``output`` has the
        flat key ``"a/b"`` itself (summaries flatten nested dicts that way), which then wins (at
        every level: ``"raw/val/loss"`` finds ``output["raw/val"]["loss"]``); or a callable
        ``output -> value``.

    Values with an ``.item()`` method (torch tensors, NumPy scalars and 1-element arrays) are
    converted with it, without importing their library.

    Raises:
      MetricNotFoundError: (a ``KeyError``) the key is missing; the message names the metric and
        lists the keys the output has (nested ones as ``a/b``).
      TypeError: the value is not a number (e.g. a whole nested dict, or a string).
    """
    value = metric(output) if callable(metric) else _lookup(output, metric)
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, (Mapping, str, bytes)) or value is None:
        raise TypeError(
            f"metric {metric_name(metric)!r} is {type(value).__name__} {value!r:.200}, not a number"
            + (f"; name a nested key as '{metric}/<key>'" if isinstance(value, Mapping) and isinstance(metric, str) else "")
        )
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {metric_name(metric)!r} is not a number: {value!r:.200} ({e})") from None


def check_metric(output: Mapping[str, Any], metric: Metric, owner: str) -> None:
    """Check that :func:`get_metric` reads ``metric`` from ``output`` as a number (the
    :class:`~cadence.extensions.ChecksOutputs` check of the actions that read one metric).

    Raises:
      ConfigError: the metric is missing (the message names it, ``owner`` and the keys
        ``output`` has) or is not a number.
    """
    try:
        get_metric(output, metric)
    except MetricNotFoundError as e:
        available = ", ".join(repr(k) for k in e.available) if e.available else "none (the output is empty)"
        raise ConfigError(f"{owner}: metric {e.metric!r} is not in the evaluation outputs; available: {available}") from None
    except Exception as e:  # a callable metric's own error, a non-number, a tensor of several elements
        raise ConfigError(f"{owner}: metric {metric_name(metric)!r} cannot be read as a number: {e}") from None


def metric_name(metric: Metric) -> str:
    """A name for ``metric`` in messages: the key, or the callable's name."""
    if isinstance(metric, str):
        return metric
    return getattr(metric, "__qualname__", None) or getattr(metric, "__name__", None) or repr(metric)


def is_better(value: float, reference: float | None, *, higher_is_better: bool, min_delta: float = 0.0) -> bool:
    """Whether ``value`` improves on ``reference`` by more than ``min_delta`` (>= 0), strictly, in
    the direction ``higher_is_better``: ``value > reference + min_delta`` or
    ``value < reference - min_delta``; equal values never improve.

    A non-finite ``value`` (NaN, +-inf) never improves, whatever the reference; any finite value
    improves on a ``None`` reference (nothing to beat yet). The one comparison of the best-value
    actions (``NewBestMetric``, ``EarlyStopping``, ``BestCheckpointExporter``) and the sidecar.
    """
    if not math.isfinite(value):
        return False
    if reference is None:
        return True
    return value > reference + min_delta if higher_is_better else value < reference - min_delta


def same_metric(state: Mapping[str, Any], metric: Metric, higher_is_better: bool, owner: str) -> bool:
    """Whether a checkpointed state was saved for the same metric and direction (else warn)."""
    saved_metric = state.get("metric")
    saved_direction = state.get("higher_is_better")
    if isinstance(metric, str) and isinstance(saved_metric, str) and saved_metric != metric:
        logger.warning(
            "%s: the checkpoint's state is for metric %r, not %r; ignoring it", owner, saved_metric, metric
        )
        return False
    if isinstance(saved_direction, bool) and saved_direction != higher_is_better:
        logger.warning(
            "%s(%r): the checkpoint's state is for higher_is_better=%s; ignoring it",
            owner, metric_name(metric), saved_direction,
        )
        return False
    return True
