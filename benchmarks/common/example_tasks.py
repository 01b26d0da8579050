"""The examples' Tasks for the benchmarks, loaded by file path under a module name of their own: every
example's file is called ``task.py``, so ``from task import ...`` would get whichever one was imported
first in this process (the digits example's, in a test worker that ran its tests before)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_task_class(example: str, name: str) -> Any:
    """The class ``name`` of ``examples/<example>/task.py`` (module ``cadence_example_<example>``, loaded once)."""
    module_name = f"cadence_example_{example}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / example / "task.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)
