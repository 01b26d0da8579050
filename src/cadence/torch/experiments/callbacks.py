"""The callbacks of a run built from a config: the task's, the config's ``callbacks:``, and the
``loggers:`` (trackers) as one callback."""

from __future__ import annotations

from typing import Any

from cadence.config import ExperimentConfig
from cadence.torch.experiments.task_loader import instantiate, load_class
from cadence.torch.task.task import Task

__all__ = ["build_callbacks", "tracking_callbacks"]


def build_callbacks(cfg: ExperimentConfig, task: Task) -> list[Any]:
    """The run's callbacks: ``task.build_callbacks()``, then the config's ``callbacks:``, each
    built as ``Class(**params)``.

    Raises:
      ConfigError: a class that cannot be imported (naming ``callbacks[i].class``) or that
        rejects its params (naming ``callbacks[i].params``).
    """
    callbacks = list(task.build_callbacks())
    for i, entry in enumerate(cfg.callbacks):
        cls = load_class(entry.class_path, f"callbacks[{i}].class")
        callbacks.append(instantiate(cls, entry.params, f"callbacks[{i}].params"))
    return callbacks


def tracking_callbacks(cfg: ExperimentConfig, chief: bool, *, eval_name: str | None = None,
              export: str | None = None) -> list[Any]:
    """The config's ``loggers:``, each tracker a callback (``[]``: none set; none on a rank that is
    not the chief): the evaluations under ``eval_name`` (default ``eval``), and at the end the
    newest export of ``export`` (the one this process writes). ConfigError when a tracker's extra
    is missing."""
    from cadence.trackers import build_trackers

    return list(build_trackers(cfg, chief=chief, eval_name=eval_name, export=export))
