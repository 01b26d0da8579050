"""Lazy public names for cadence's packages (PEP 562): each is imported from its module on first
use, so that importing a package stays light (``import cadence`` never imports torch)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Mapping


def lazy_attributes(
    package: str, exports: Mapping[str, str], names: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for module ``package``.

    ``__getattr__(name)`` imports the module ``exports[name]``, takes ``name`` from it and keeps
    it in ``package`` (later lookups are plain attribute reads); a name not in ``exports`` raises
    ``AttributeError``. ``__dir__()`` lists ``names`` sorted.
    """
    listed = sorted(names)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
