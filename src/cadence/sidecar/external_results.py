"""What an external evaluator's run is given and what it gives back: its templates filled in
(:func:`render`, :func:`command_argv`), its JSON result found (:func:`last_json_object` on stdout,
:func:`newest_match` for a result file) and turned into metrics (:func:`to_metrics`)."""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Mapping

from cadence.config.components.external_evaluators import ExternalEvaluatorConfig, split_command

__all__ = ["ResultError", "command_argv", "last_json_object", "last_line", "newest_match", "read_result", "render",
           "to_metrics"]


class ResultError(Exception):
    """The command ran, but its JSON result is missing or not an object (the attempt failed)."""


def render(template: str, values: Mapping[str, str]) -> str:
    """``template`` with its ``{field}`` s filled in from ``values`` (the fields were checked when the
    config was loaded; ``{{`` and ``}}`` are braces)."""
    return template.format_map(values)


def command_argv(spec: ExternalEvaluatorConfig, values: Mapping[str, str]) -> list[str]:
    """The command's arguments, split first (a string as a shell would), then each rendered: a path
    with spaces stays one argument."""
    return [render(argument, values) for argument in split_command(spec.command)]


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that is a JSON object (a log line, a table before it do not
    matter); else the whole text when it is one (pretty-printed); else None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def newest_match(pattern: str) -> str | None:
    """The newest file (modification time, then name) matching the glob ``pattern`` (``**``: any
    depth), or None."""
    files = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    return max(files, key=lambda p: (os.path.getmtime(p), p)) if files else None


def read_result(spec: ExternalEvaluatorConfig, values: Mapping[str, str], stdout: str) -> dict[str, Any]:
    """The JSON object the command gave: from ``stdout`` or from its result file (``spec.result``).
    ResultError when there is none."""
    if spec.result == "stdout":
        found = last_json_object(stdout)
        if found is None:
            raise ResultError("no JSON object on its standard output")
        return found
    pattern = render(spec.result, values)
    path = newest_match(pattern)
    if path is None:
        raise ResultError(f"no result file {pattern}")
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise ResultError(f"result file {path}: {e}") from None
    if not isinstance(found, dict):
        raise ResultError(f"result file {path} holds no JSON object")
    return found


def _key(key: str) -> str:
    """lm-eval's ``metric,filter`` keys: ``metric`` for the filter ``none``, else ``metric/filter``."""
    if "," not in key:
        return key
    metric, flt = key.split(",", 1)
    return metric if flt == "none" else f"{metric}/{flt}"


def _flatten(node: Mapping[str, Any], prefix: str, out: dict[str, float]) -> None:
    for key, value in node.items():
        name = f"{prefix}/{_key(str(key))}"
        if isinstance(value, Mapping):
            _flatten(value, name, out)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value) if isinstance(value, float) else value


def to_metrics(result: Mapping[str, Any], select: str | None, prefix: str) -> dict[str, float]:
    """The numbers of ``result`` (of its part at the ``/`` path ``select``) as flat metrics
    ``<prefix>/<key>/...``: nested objects joined with ``/``, lm-eval's ``metric,filter`` keys
    renamed (:func:`_key`), strings, booleans, lists, nulls and non-finite numbers dropped.
    ResultError when ``select`` is not an object there."""
    node: Any = result
    for part in (select or "").split("/"):
        if not part:
            continue
        if not isinstance(node, Mapping) or part not in node:
            raise ResultError(f"the result has no {select!r} object")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ResultError(f"the result's {select!r} is not an object")
    out: dict[str, float] = {}
    _flatten(node, prefix, out)
    return out


def last_line(*texts: str, limit: int = 500) -> str:
    """The last non-blank line of the first of ``texts`` that has one (a command's stderr, then its
    stdout), shortened to ``limit`` characters."""
    for text in texts:
        for line in reversed(text.splitlines()):
            line = line.strip()
            if line:
                return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""
