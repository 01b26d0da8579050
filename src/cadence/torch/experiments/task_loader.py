"""Loading the classes a config names (``module:Class`` or ``file.py:Class``) and building the
configured :class:`~cadence.torch.task.task.Task`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any, Mapping

from cadence.config import ExperimentConfig
from cadence.errors import ConfigError, one_line
from cadence.torch.hf.dependency import missing_extra_hint
from cadence.torch.task.task import Task

__all__ = ["build_task", "instantiate", "load_class", "load_task_class"]


def load_class(spec: str, field: str) -> type:
    """Import the class named by ``module:ClassName`` or ``/path/to/file.py:ClassName``.

    A module is imported from ``sys.path`` (plus the current directory); a file is loaded once
    per process, with its directory put on ``sys.path`` so that it can import its siblings.
    ``ClassName`` may be dotted (``Outer.Inner``). ``field`` (e.g. ``task.class``,
    ``callbacks[0].class``) starts every error message.

    Raises:
      ConfigError: malformed spec, module or file not importable (not found, a syntax error, an
        exception raised while it is imported: one line naming the module, the file and the line),
        no such class, not a class.
    """
    module_name, sep, class_name = spec.rpartition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"{field}: expected 'module:ClassName' or 'file.py:ClassName', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{field}: file not found: {path}")
            name = f"cadence_task_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                if module_spec is None or module_spec.loader is None:
                    raise ConfigError(f"{field}: cannot load {path} as a Python module")
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                sys.path.insert(0, str(path.resolve().parent))  # let the file import its siblings
                try:
                    module_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]  # a fixed file can be loaded again
                    raise
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{field}: cannot import module {module_name!r}: {exc}{missing_extra_hint(exc)}") from exc
    except SyntaxError as exc:  # in the module, or in one it imports: that file and line
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else f"line {exc.lineno}"
        raise ConfigError(f"{field}: cannot import module {module_name!r}: {where}: "
                          f"{type(exc).__name__}: {exc.msg}") from exc
    except ConfigError:
        raise
    except Exception as exc:  # raised by the module's code as it was imported
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigError(f"{field}: importing module {module_name!r} raised {one_line(exc)} "
                          f"({frame.filename}, line {frame.lineno})") from exc
    cls: Any = module
    for part in class_name.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise ConfigError(f"{field}: module {module_name!r} has no class {class_name!r}")
    if not isinstance(cls, type):
        raise ConfigError(f"{field}: {spec} is not a class")
    return cls


def load_task_class(spec: str) -> type[Task]:
    """Import ``module:ClassName`` or ``/path/to/file.py:ClassName`` and check it is a Task.

    Raises:
      ConfigError: malformed spec, module or file not importable, no such class, not a Task.
    """
    cls = load_class(spec, "task.class")
    if not issubclass(cls, Task):
        raise ConfigError(f"task.class: {spec} is not a subclass of cadence.torch.Task")
    return cls


def instantiate(cls: type, params: Mapping[str, Any], field: str) -> Any:
    """``cls(**params)``; a constructor rejecting them raises ConfigError naming ``field``."""
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{field}: {cls.__name__}(**params) failed: {exc}") from exc


def build_task(cfg: ExperimentConfig) -> Task:
    """Instantiate the configured Task with ``task.params`` as keyword arguments."""
    return instantiate(load_task_class(cfg.task.class_path), cfg.task.params, "task.params")
