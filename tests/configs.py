"""The tests' one tiny-config builder: a cadence YAML config for a tiny task, written to a file.

``config_data(task, params=..., trainer=..., **sections)`` is the config as a dict; ``write_config(directory,
...)`` writes it as ``directory/config.yaml`` (created if missing) and returns the path. The trainer
section starts from :data:`TRAINER` (24 steps, loops of 4, a checkpoint and a validation every 8) and
takes the caller's keys over it; every other section is the caller's. ``task`` is ``"Class"`` (a class
of tests/tasks.py), ``"file.py:Class"`` (a file of tests/) or any ``module:Class`` / ``path:Class``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TESTS = Path(__file__).resolve().parent
TRAINER: dict[str, Any] = {"train_steps": 24, "steps_per_loop": 4, "checkpoint_interval": 8,
                           "validation_interval": 8, "max_to_keep": None, "seed": 1}
"""The trainer section's defaults: short, with a checkpoint and a validation every 8 steps."""


def task_spec(task: str = "TinyTask") -> str:
    """``task`` as a config's ``task.class``: a bare class name is one of tests/tasks.py, a
    ``file.py:Class`` with a bare file name is a file of tests/."""
    if ":" not in task:
        return f"{TESTS / 'tasks.py'}:{task}"
    module, _, name = task.rpartition(":")
    if module.endswith(".py") and "/" not in module:
        return f"{TESTS / module}:{name}"
    return task


def config_data(task: str = "TinyTask", *, params: dict[str, Any] | None = None,
                trainer: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    """The config as a dict: ``task`` (see :func:`task_spec`) with ``params``, :data:`TRAINER` updated
    by ``trainer`` (a key given as None stays, as None), then the other ``sections`` as given."""
    return {"task": {"class": task_spec(task), "params": dict(params or {})},
            "trainer": {**TRAINER, **(trainer or {})}, **sections}


def write_config(directory: Path, task: str = "TinyTask", *, name: str = "config.yaml",
                 params: dict[str, Any] | None = None, trainer: dict[str, Any] | None = None,
                 **sections: Any) -> Path:
    """:func:`config_data` written as YAML to ``directory/name``; the file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(config_data(task, params=params, trainer=trainer, **sections)))
    return path
