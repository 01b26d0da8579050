"""Scalar metrics: what counts as one (Python and NumPy numbers, one-element tensors), nested
metrics flattened to ``a/b`` keys, and a metric's JSON form."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["flatten_scalars", "json_value", "to_scalar"]


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
    (strict JSON has no NaN), a mapping (named splits' metrics) converted value by value,
    anything else unchanged."""
    if isinstance(value, Mapping):
        return {key: json_value(v) for key, v in value.items()}
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
