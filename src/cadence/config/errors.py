"""Config error messages, one line per problem, naming where the value came from (the file and
line, or the ``--set`` that set it) and the field as users write it (``callbacks[0].class``).

What a field accepts is said in words derived from the schema (:func:`expected`): its type,
bounds and choices, or the words the field declares itself (``json_schema_extra={"expected":
...}``). So every field's wrong value reads the same way: ``path: expected <words>, got <value>``.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from cadence.config.schema import MOVED_KEYS, ExperimentConfig
from cadence.config.yaml_io import Loc

__all__ = [
    "display_path",
    "expected",
    "field_info",
    "field_names",
    "moved_key_errors",
    "short_repr",
    "submodel",
    "suggest",
    "validation_message",
]

_LISTED_OPTIONAL = 4  # a section with more optional fields than this is "a mapping"


# -- the schema, as users write it ------------------------------------------------------------


def field_info(model: type[BaseModel], key: str) -> FieldInfo | None:
    """The field ``key`` (its name or alias) of ``model``, or None."""
    for name, info in model.model_fields.items():
        if key == name or key == info.alias:
            return info
    return None


def field_names(model: type[BaseModel]) -> list[str]:
    """The names users write: aliases where there are aliases."""
    return [info.alias or name for name, info in model.model_fields.items()]


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field annotated ``Model`` or ``Model | None``, else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _model_at(loc: Sequence[str]) -> type[BaseModel] | None:
    """The model holding the field at ``loc`` (aliases; list items by index), if in the schema."""
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list of sections (callbacks.0.class)
            continue
        info = field_info(model, part)
        sub = submodel(info.annotation) if info is not None else None
        if sub is None:
            return None
        model = sub
    return model


def suggest(word: str, choices: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def printable(text: str) -> str:
    """``text`` with each character that is not printable (a newline, a control character) written
    as its escape, so that a message quoting it stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def display_path(loc: Sequence[Any]) -> str:
    """A config location as users write it: ``trainer.recovery.max_trials``, ``callbacks[0].class``
    (a character that is not printable, in a key, written as its escape)."""
    path = ""
    for part in loc:
        index = isinstance(part, int) or (isinstance(part, str) and part.isdigit())
        text = printable(str(part))
        path += f"[{text}]" if index else (f".{text}" if path else text)
    return path


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr`` for error messages, with YAML's spelling of null and booleans, shortened."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- what a field accepts, in words -----------------------------------------------------------


def expected(info: FieldInfo) -> str:
    """What the field accepts, in words: its declared ``expected``, else derived from its type
    and constraints; ``" or null"`` when it may be null."""
    annotation, nullable = _strip_none(info.annotation)
    extra = info.json_schema_extra
    declared = extra.get("expected") if isinstance(extra, dict) else None
    words = declared if isinstance(declared, str) else _describe(annotation, info.metadata)
    if not nullable:
        return words
    return f"{words}, or null" if " with " in words else f"{words} or null"


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else annotation), nullable
    return annotation, False


def _describe(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if annotation is bool:
        return "true or false"
    if annotation in (int, float):
        return ("an integer" if annotation is int else "a number") + _bounds(metadata)
    if annotation is str:
        return "a string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _describe_section(annotation)
    if isinstance(origin, type) and issubclass(origin, Mapping):
        return "a mapping"
    if origin is list:
        item = args[0] if args else Any
        if typing.get_origin(item) is Literal:
            return "a list of " + ", ".join(repr(a) for a in typing.get_args(item))
        return "a list of " + _describe(item).replace("a mapping", "mappings", 1).removeprefix("an ").removeprefix("a ")
    return "a value of type " + getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Sequence[Any]) -> str:
    low = next((f">= {m.ge}" for m in metadata if isinstance(m, Ge)), None) or \
        next((f"> {m.gt}" for m in metadata if isinstance(m, Gt)), None)
    high = next((m.le for m in metadata if isinstance(m, Le)), None)
    if low is not None and low.startswith(">=") and high is not None:
        return f" from {low[3:]} to {high}"
    parts = [p for p in (low, f"<= {high}" if high is not None else None,
                         next((f"< {m.lt}" for m in metadata if isinstance(m, Lt)), None)) if p]
    return (" " + " and ".join(parts)) if parts else ""


def _describe_section(model: type[BaseModel]) -> str:
    """``a mapping with 'metric' and optional 'higher_is_better'``; a section with many optional
    fields is just ``a mapping``."""
    required = [repr(info.alias or name) for name, info in model.model_fields.items() if info.is_required()]
    optional = [repr(info.alias or name) for name, info in model.model_fields.items() if not info.is_required()]
    listed = ", ".join(required)
    if optional and len(optional) <= _LISTED_OPTIONAL:
        listed += (" and " if listed else "") + "optional " + ", ".join(optional)
    return "a mapping" + (" with " + listed if listed else "")


# -- messages ---------------------------------------------------------------------------------


def _format_error(err: Mapping[str, Any]) -> tuple[Loc, str]:
    """``(loc, "path: problem")`` for one pydantic error."""
    raw = tuple(err["loc"])
    loc = tuple(str(p) for p in raw)
    path = display_path(raw) or "(top level)"
    kind, value = err["type"], err.get("input")
    model = _model_at(loc) if loc else None
    if kind == "extra_forbidden":
        hint = suggest(loc[-1], field_names(model)) if model is not None else None
        return loc, f"{path}: unknown field" + (f" (did you mean {hint!r}?)" if hint else "")
    if kind == "missing":
        return loc, f"{path}: required field missing"
    if kind in ("value_error", "assertion_error"):
        message = str(err.get("ctx", {}).get("error") or err["msg"]).removeprefix("Value error, ")
        if not loc:  # a rule across fields: the message names them; the input is the whole file
            return loc, message
        return loc, f"{path}: {message}, got {short_repr(value)}"
    words = _expected_at(loc)
    if words is not None:
        return loc, f"{path}: expected {words}, got {short_repr(value)}"
    message = err["msg"][:1].lower() + err["msg"][1:]
    return loc, f"{path}: {message} (got {short_repr(value)})"


def _expected_at(loc: Loc) -> str | None:
    """The expected words of the field at ``loc``, or of a list field's item (``formats.1``)."""
    if not loc:
        return None
    if loc[-1].isdigit():  # an item of a list of values
        model = _model_at(loc[:-1])
        info = field_info(model, loc[-2]) if model is not None and len(loc) > 1 else None
        items = typing.get_args(_strip_none(info.annotation)[0]) if info is not None else ()
        return _describe(items[0]) if items and submodel(items[0]) is None else None
    model = _model_at(loc)
    info = field_info(model, loc[-1]) if model is not None else None
    return expected(info) if info is not None else None


def validation_message(exc: ValidationError, source: str, lines: Mapping[Loc, int],
                       overridden: Mapping[Loc, str]) -> str:
    """One line per error, prefixed by where the value came from (file + line, or --set).

    File errors come first, in line order; then the overrides' errors.
    """
    out: list[tuple[int, float, str]] = []
    for err in exc.errors():
        loc, text = _format_error(err)
        origin = _override_for(loc, overridden)
        if origin is not None:
            out.append((1, 0, f"{origin}: {text}"))
            continue
        line = _line_for(loc, lines)
        out.append((0, line or 0, f"{source}: {text}" + (f" (line {line})" if line else "")))
    return "\n".join(text for _, _, text in sorted(out, key=lambda e: e[:2]))


def moved_key_errors(data: Mapping[str, Any], source: str, lines: Mapping[Loc, int],
                     overridden: Mapping[Loc, str]) -> str:
    """One line per key of an earlier version that ``data`` still has, naming the new key;
    ``""`` when there is none."""
    found = []
    for loc, new in MOVED_KEYS.items():
        section = data.get(loc[0])
        if isinstance(section, Mapping) and loc[1] in section:
            origin = _override_for(loc, overridden)
            line = _line_for(loc, lines)
            where = origin if origin is not None else source
            found.append(f"{where}: {display_path(loc)}: moved to {new}" + (f" (line {line})" if line and
                                                                               origin is None else ""))
    return "\n".join(found)


def _override_for(loc: Loc, overridden: Mapping[Loc, str]) -> str | None:
    """The override that set ``loc`` or one of its parents (the last one applied wins)."""
    for i in range(len(loc), 0, -1):
        if loc[:i] in overridden:
            return overridden[loc[:i]]
    return None


def _line_for(loc: Loc, lines: Mapping[Loc, int]) -> int | None:
    for i in range(len(loc), 0, -1):
        if loc[:i] in lines:
            return lines[loc[:i]]
    return None
