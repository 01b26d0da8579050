"""Class specs in a config (``task.class``, ``callbacks[i].class``): their form, and relative
``file.py`` paths resolved against the config file's directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from cadence.storage import is_plain_path

__all__ = ["CLASS_SPEC_FORM", "check_class_spec", "portable_class_path", "resolve_class_path"]

CLASS_SPEC_FORM = "'module:ClassName' or 'path/to/file.py:ClassName'"
"""The accepted forms, in words, for messages."""

_CLASS_SPEC_RE = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*|.+\.py)"  # dotted module, or a path to a .py file
    r":(?P<cls>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)$"  # class name (Outer.Inner allowed)
)


def check_class_spec(value: str) -> str:
    """``value`` stripped; ValueError unless it is ``module:Class`` or ``file.py:Class``."""
    value = value.strip()
    if not _CLASS_SPEC_RE.match(value):
        raise ValueError(f"expected {CLASS_SPEC_FORM}")
    return value


def resolve_class_path(spec: str, config_dir: str | Path | None = None) -> str:
    """A class spec with a relative ``file.py`` made absolute against ``config_dir`` (None: the
    current directory); ``module:Class`` and URLs are unchanged."""
    module, _, cls = spec.rpartition(":")
    if not module.endswith(".py") or not is_plain_path(module):
        return spec
    path = Path(module).expanduser()
    if not path.is_absolute():
        base = Path(config_dir) if config_dir is not None else Path.cwd()
        path = base / path
    return f"{os.path.abspath(path)}:{cls}"


def portable_class_path(spec: str, directory: str | Path) -> str:
    """A resolved class spec as a config file in the local ``directory`` should record it: a
    ``file.py`` path relative to ``directory`` when the file and ``directory`` both lie inside the
    current working directory (the project the run was started from), so that moving the project
    -- code and model dirs together -- keeps the config working; otherwise (code or model dir
    elsewhere) unchanged: absolute. ``module:Class`` specs and URLs are always unchanged."""
    module, _, cls = spec.rpartition(":")
    if not module.endswith(".py") or not is_plain_path(module) or not os.path.isabs(module):
        return spec
    cwd = os.path.realpath(os.getcwd())
    code, target = os.path.realpath(module), os.path.realpath(directory)
    inside = all(os.path.commonpath([cwd, path]) == cwd for path in (code, target))
    return f"{os.path.relpath(code, target)}:{cls}" if inside else spec
