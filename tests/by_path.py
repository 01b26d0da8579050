"""Modules loaded from a file's path under a name of their own (an example's ``task.py``, its
``prepare.py``): two examples' ``task`` modules never collide in one test process."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator


def load_module(name: str, path: Path) -> ModuleType:
    """The module of ``path`` as ``sys.modules[name]`` (dataclasses and pickling look it up by name),
    executed on the first call and the same module afterwards."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@contextlib.contextmanager
def module_loaded(name: str, path: Path) -> Iterator[ModuleType]:
    """:func:`load_module` for the ``with`` block only: the name is free again afterwards."""
    try:
        yield load_module(name, path)
    finally:
        sys.modules.pop(name, None)
