"""tf.estimator's ``train_and_evaluate`` for cadence: one call in every process of an
experiment, and the process's role (:func:`cadence.cluster.roles.resolve_role`) decides what it does."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cadence.cluster.roles import ClusterSpec, resolve_role
from cadence.config import ExperimentConfig, TaskConfig, config_from_dict, load_config
from cadence.errors import ConfigError
from cadence.sidecar.evaluator import SidecarResult

__all__ = ["train_and_evaluate"]


def train_and_evaluate(
    task_or_config: Any,
    config: Any = None,
    *,
    role: str | ClusterSpec | None = None,
    environ: Mapping[str, str] | None = None,
    progress: bool | None = None,
) -> dict[str, Any] | SidecarResult:
    """Run this process's part of an experiment, tf.estimator style.

    ``train_and_evaluate(cfg)`` or ``train_and_evaluate(TaskClass, cfg)``: the same call runs in
    every process; the role (:func:`~cadence.cluster.roles.resolve_role`) decides what it does:

    * evaluator: the sidecar (:func:`cadence.torch.experiments.experiment.run_sidecar`) evaluates
      checkpoints as the trainers commit them, until the final one;
    * chief / worker: trains (:func:`cadence.torch.experiments.experiment.run_training`), validating
      in-process unless the cluster has a separate evaluator or
      ``trainer.in_process_validation`` is false.

    Args:
      task_or_config: an :class:`~cadence.config.ExperimentConfig` (or a mapping or a YAML path
        that loads into one); or the task -- a Task class, a Task instance (its class is used; its
        constructor arguments come from ``config``'s ``task.params``), or a ``"module:Class"``
        string -- with the config as the second argument.
      config: the config, when the first argument is the task.
      role: ``"chief"`` | ``"worker"`` | ``"evaluator"`` or a :class:`~cadence.cluster.roles.ClusterSpec`;
        ``None``: from the environment.
      environ: the environment to read the role from (default ``os.environ``).
      progress: the trainer's progress display (``None``: its default); the sidecar has none.

    Returns:
      The trainer's last evaluation metrics (a dict; ``{}`` without in-process validation), or,
      for the evaluator role, the sidecar's :class:`~cadence.sidecar.evaluator.SidecarResult`.

    Raises:
      ConfigError: a bad role or config.
    """
    from cadence.torch.experiments import experiment  # looked up at call time: tests replace its functions

    spec = role if isinstance(role, ClusterSpec) else resolve_role(environ, explicit=role)
    cfg = _experiment_config(task_or_config, config)
    if spec.role == "evaluator":
        return experiment.run_sidecar(cfg)
    extra = {} if progress is None else {"progress": progress}
    # A separate evaluator in the cluster turns in-process validation off; otherwise the
    # config's trainer.in_process_validation decides (None).
    return experiment.run_training(cfg, in_process_validation=False if spec.has_evaluator else None, **extra)


def _experiment_config(task_or_config: Any, config: Any) -> ExperimentConfig:
    if config is None:
        if _is_task(task_or_config):
            raise TypeError("train_and_evaluate(task, config): the config is missing")
        return _as_config(task_or_config, None)
    if isinstance(task_or_config, ExperimentConfig):
        raise TypeError("train_and_evaluate(config, ...): give the config once, or (task, config)")
    return _as_config(config, _task_spec(task_or_config))


def _is_task(obj: Any) -> bool:
    return not isinstance(obj, (ExperimentConfig, Mapping, str, os.PathLike))  # a lone str: a path


def _task_spec(task: Any) -> str:
    """``module:QualName`` for a Task class, instance or spec string."""
    if isinstance(task, str):
        return task
    cls = task if isinstance(task, type) else type(task)
    if "<locals>" in cls.__qualname__:
        raise ConfigError(
            f"task.class: {cls.__qualname__} is defined inside a function; define it at module "
            "level so that every process can import it"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def _as_config(config: Any, task_spec: str | None) -> ExperimentConfig:
    if isinstance(config, ExperimentConfig):
        if task_spec is None:
            return config
        try:
            task = TaskConfig.model_validate({"class": task_spec, "params": config.task.params,
                                              "init_from_pretrained": config.task.init_from_pretrained})
        except ValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            raise ConfigError(f"task.class: {task_spec!r}: {problems}") from None
        cfg = config.model_copy(update={"task": task})
        cfg._config_dir = config.config_dir
        return cfg
    if isinstance(config, Mapping):
        data = dict(config)
        if task_spec is not None:
            given = data.get("task") or {}
            if not isinstance(given, Mapping):
                raise ConfigError(f"task: expected a mapping, got {given!r}")
            data["task"] = {**given, "class": task_spec}
        return config_from_dict(data)
    if isinstance(config, (str, os.PathLike)):
        cfg = load_config(Path(config) if isinstance(config, os.PathLike) else config)
        return _as_config(cfg, task_spec) if task_spec is not None else cfg
    raise TypeError(
        f"train_and_evaluate: expected an ExperimentConfig, a mapping or a config path, got "
        f"{type(config).__name__}"
    )
