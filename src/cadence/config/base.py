"""The base of every config model (a section of the experiment config, a component's settings):
unknown keys are errors, a commented-out section reads as empty, no number is infinite or NaN
(every duration is at most :data:`MAX_SECONDS`), and a number outside a field's
bounds says so in the field's words (``decay must be > 0 and < 1, got 1.0``) whether the model is
built from YAML or in code."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["MAX_INT", "MAX_SECONDS", "ConfigModel"]

MAX_INT = 2**63 - 1
"""The largest integer a config takes (steps, sizes, counts are saved as int64)."""

MAX_SECONDS = 366 * 24 * 3600
"""The longest duration, interval or ttl a config takes, in seconds (a year): a longer one is a
mistake, and far beyond it the clock arithmetic of leases and waits overflows (``1e300``)."""

_BOUNDS: tuple[tuple[type, str, str, Any], ...] = (
    (Ge, "ge", ">=", lambda v, b: v >= b), (Gt, "gt", ">", lambda v, b: v > b),
    (Le, "le", "<=", lambda v, b: v <= b), (Lt, "lt", "<", lambda v, b: v < b),
)
_ERROR_TYPES = {"ge": "greater_than_equal", "gt": "greater_than", "le": "less_than_equal", "lt": "less_than"}


class ConfigModel(BaseModel):
    """A config model: ``extra="forbid"``, fields by name or alias; see the module."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_empty(cls, data: Any) -> Any:
        """A section, mapping or list of sections with every entry commented out is YAML ``null``:
        read as empty. (Where null is a value of its own, ``X | None``, it stays null.)"""
        if not isinstance(data, dict):
            return data
        empty = _empty_values(cls)
        return {k: (empty[k]() if v is None and k in empty else v) for k, v in data.items()}

    @field_validator("*", mode="before")
    @classmethod
    def _within_bounds(cls, value: Any, info: ValidationInfo) -> Any:
        """A number outside the field's bounds: ``<field> must be > 0 and < 1, got 1.0`` (pydantic's
        error type is kept, so a config file's message still reads ``expected ..., got ...``)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or info.field_name is None:
            return value
        bounds = _bounds_of(cls, info.field_name)
        broken = next((kind for kind, _, bound, holds in bounds if not holds(value, bound)), None)
        if broken is None:
            if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:  # within the field's own bounds
                raise PydanticCustomError("value_error", "an integer must fit in 64 bits (at most 2**63 - 1)")
            return value
        words = " and ".join(f"{op} {bound}" for _, op, bound, _ in bounds)
        raise PydanticCustomError(_ERROR_TYPES[broken], f"{info.field_name} must be {words}, got {value!r}")


@functools.cache
def _bounds_of(model: type[BaseModel], name: str) -> tuple[tuple[str, str, Any, Any], ...]:
    """``(kind, operator, bound, check)`` of each numeric bound of ``model``'s field ``name``."""
    info = model.model_fields.get(name)
    if info is None:
        return ()
    return tuple((kind, op, getattr(m, kind), holds) for m in info.metadata
                 for cls, kind, op, holds in _BOUNDS if isinstance(m, cls))


@functools.cache
def _empty_values(model: type[BaseModel]) -> dict[str, type[dict[str, Any]] | type[list[Any]]]:
    """The keys (names and aliases) of ``model``'s fields that hold sections or mappings, each with
    the type of its empty value (``dict`` or ``list``)."""
    out: dict[str, type[dict[str, Any]] | type[list[Any]]] = {}
    for name, info in model.model_fields.items():
        annotation, origin = info.annotation, get_origin(info.annotation)
        if _is_section(annotation) or (isinstance(origin, type) and issubclass(origin, Mapping)):
            out[name] = out[info.alias or name] = dict
        elif origin is list and _is_section(get_args(annotation)[0]):
            out[name] = out[info.alias or name] = list
    return out


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
