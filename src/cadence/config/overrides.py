"""``--set dotted.key=value`` overrides: parsed (the value as YAML), checked against the schema
(an unknown or moved key is an error naming the right one), and applied to the plain data of a
config before it is validated."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from cadence.config.errors import display_path, field_info, field_names, printable, short_repr, submodel, suggest
from cadence.config.schema import MOVED_KEYS, ExperimentConfig
from cadence.config.yaml_io import Loc, load_value
from cadence.errors import ConfigError

__all__ = ["apply_flags", "apply_override", "apply_overrides", "check_override_path", "parse_override"]


_KEY_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def _origin(text: str, limit: int = 80) -> str:
    """How messages name an override: ``--set key=value``, shortened past ``limit`` characters, a
    character that is not printable (a newline, a control character) written as its escape so
    that the message stays one line."""
    shown = printable(text)
    return "--set " + (shown if len(shown) <= limit else shown[: limit - 3] + "...")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Split ``dotted.key=value`` into ``(["dotted", "key"], value)``; the value is YAML.

    ``a.b=5`` gives ``5``, ``a.b=null`` gives ``None``, ``a.b=[64, 32]`` a list, ``a.b=x`` the
    string ``"x"``. A ``[N]`` after a name indexes a list, as config errors write it:
    ``callbacks[0].params.path=x`` gives ``(["callbacks", 0, "params", "path"], "x")``.
    Raises ConfigError when there is no ``=``, the key is malformed, or the value is not valid
    YAML. The key path is not checked against the schema here.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"{_origin(text)}: expected key=value")
    parts: list[str | int] = []
    for segment in key.split("."):
        match = _KEY_PART.fullmatch(segment.strip())
        if match is None or not match.group(1).strip():
            raise ConfigError(f"{_origin(text)}: malformed key {key!r} (expected dotted.key=value, "
                              "or name[N] for a list item)")
        parts.append(match.group(1).strip())
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    value = load_value(raw, f"{_origin(text)}")
    return parts, value


def check_override_path(parts: Sequence[str | int], text: str) -> list[str | int]:
    """The key path with aliases canonical (``task.class``); ConfigError if not in the schema.

    An index must follow a list field (``callbacks[0]``); a list of sections is entered
    (``callbacks[0].params``), a list of values is set item by item (``export.formats[1]``).
    """
    moved = MOVED_KEYS.get(tuple(str(p) for p in parts[:2]))
    if moved is not None:
        raise ConfigError(f"{_origin(text)}: {display_path(parts[:2])}: moved to {moved}")
    model: type[BaseModel] | None = ExperimentConfig
    canonical: list[str | int] = []
    items: Any = None  # the annotation of a list's items, right after its field
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if model is None and items is None:  # below a free-form mapping (task.params)
            canonical.extend(parts[i:])
            break
        if isinstance(part, int):
            if items is None:
                raise ConfigError(f"{_origin(text)}: {display_path(canonical)!r} is not a list (cannot index it)")
            canonical.append(part)
            model, items = _enter(items, canonical, parts, last, text)
            continue
        if model is None:  # a name right after a list field: list fields take indexes only
            raise ConfigError(f"{_origin(text)}: {display_path(canonical)!r} is a list: "
                              f"write {display_path(canonical)}[N].{part} for its item N")
        field = field_info(model, part)
        if field is None:
            names = field_names(model)
            hint = suggest(part, names)
            if hint is not None:
                problem = f"(did you mean {display_path((*canonical, hint))!r}?)"
            else:
                problem = "(expected one of " + ", ".join(repr(display_path((*canonical, n))) for n in names) + ")"
            unknown = display_path(parts[: i + 1])
            raise ConfigError(f"{_origin(text)}: unknown field {unknown!r} {problem}")
        name = next(n for n, f in model.model_fields.items() if f is field)
        canonical.append(field.alias or name)
        sub = field.annotation
        if _list_items(sub) is not None:
            model, items = None, _list_items(sub)
        else:
            items = None
            model, _ = _enter(sub, canonical, parts, last, text)
    return canonical


def _enter(annotation: Any, canonical: Sequence[str | int], parts: Sequence[str | int], last: bool,
           text: str) -> tuple[type[BaseModel] | None, Any]:
    """``(model, None)`` to go on inside a section, ``(None, None)`` inside a free-form mapping;
    ConfigError when ``annotation`` is a plain value and the key goes on below it."""
    if submodel(annotation) is not None:
        return submodel(annotation), None
    if _is_mapping_type(annotation) or last:
        return None, None
    raise ConfigError(
        f"{_origin(text)}: {display_path(canonical)!r} is a value, not a section "
        f"(cannot set {display_path(parts)!r})"
    )


def _list_items(annotation: Any) -> Any:
    """The item annotation of a ``list[X]`` (or ``list[X] | None``) field, else None."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if getattr(candidate, "__origin__", None) is list:
            return candidate.__args__[0]
    return None


def _is_mapping_type(annotation: Any) -> bool:
    origin = getattr(annotation, "__origin__", annotation)
    return isinstance(origin, type) and issubclass(origin, Mapping)


def apply_override(data: dict[str, Any], path: Sequence[str | int], value: Any, text: str) -> None:
    node: Any = data
    for i, part in enumerate(path):
        where = display_path(path[:i])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(f"{_origin(text)}: cannot set {display_path(path)!r}: "
                                  f"{where!r} is {short_repr(node)}, not a list")
            if part >= len(node):
                raise ConfigError(f"{_origin(text)}: cannot set {display_path(path)!r}: {where!r} has "
                                  f"{len(node)} item{'s' * (len(node) != 1)} (indexes from 0)")
        elif not isinstance(node, dict):
            raise ConfigError(f"{_origin(text)}: cannot set {display_path(path)!r}: "
                              f"{where!r} is {short_repr(node)}, not a mapping")
        if i == len(path) - 1:
            node[part] = value
        elif isinstance(part, int):
            node = node[part]
        else:
            if node.get(part) is None:
                node[part] = [] if isinstance(path[i + 1], int) else {}
            node = node[part]


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[Loc, str]:
    """Apply ``overrides`` to ``data`` in order; the key path each set, by its override text
    (``{("trainer", "seed"): "--set trainer.seed=3"}``, the last one applied wins).

    Raises:
      ConfigError: a malformed override, a key outside the schema (or moved), an index past a
        list's end.
    """
    overridden: dict[Loc, str] = {}
    for text in overrides:
        parts, value = parse_override(text)
        path = check_override_path(parts, text)
        apply_override(data, path, value, text)
        overridden[tuple(str(p) for p in path)] = f"{_origin(text)}"
    return overridden


def apply_flags(data: dict[str, Any], flags: Mapping[str, tuple[str, Any]]) -> dict[Loc, str]:
    """Apply the command-line flags that set a config value (``{"--timeout": ("sidecar.timeout", 5.0)}``)
    to ``data``, as overrides named by their flag: a value the schema refuses is reported as
    ``--timeout: sidecar.timeout: ...``. Returns the key path each set, by its flag."""
    named: dict[Loc, str] = {}
    for flag, (key, value) in flags.items():
        path = check_override_path(key.split("."), flag)
        apply_override(data, path, value, flag)
        named[tuple(str(p) for p in path)] = flag
    return named
