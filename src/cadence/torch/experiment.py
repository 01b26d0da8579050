"""Build a run from an :class:`~cadence.config.ExperimentConfig`: task, runners, checkpoint
manager and controller, laid out in the model directory (DESIGN.md's contract).

This is what ``cadence train`` and ``cadence evaluate`` call; it is also the short way to run a
config from Python::

    from cadence.config import load_config
    from cadence.torch import run_training
    metrics = run_training(load_config("examples/digits/config.yaml", model_dir="runs/digits"))
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.config import ExperimentConfig, save_config
from cadence.controller import Controller
from cadence.errors import CheckpointError, ConfigError
from cadence.torch.context import Context
from cadence.torch.state import seed_everything
from cadence.torch.task import Task
from cadence.torch.trainer import build_runners

__all__ = ["Run", "load_task_class", "build_task", "build_run", "run_training", "run_evaluation"]


def load_task_class(spec: str) -> type[Task]:
    """Import ``module:ClassName`` or ``/path/to/file.py:ClassName`` and check it is a Task.

    Raises:
      ConfigError: malformed spec, module or file not importable, no such class, not a Task.
    """
    module_name, sep, class_name = spec.rpartition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"task.class: expected 'module:ClassName' or 'file.py:ClassName', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"task.class: file not found: {path}")
            name = f"cadence_task_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                sys.path.insert(0, str(path.resolve().parent))  # let the file import its siblings
                module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"task.class: cannot import module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"task.class: module {module_name!r} has no class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task.class: {spec} is not a subclass of cadence.torch.Task")
    return cls


def build_task(cfg: ExperimentConfig) -> Task:
    """Instantiate the configured Task with ``task.params`` as keyword arguments."""
    cls = load_task_class(cfg.task.task_class)
    try:
        return cls(**cfg.task.params)
    except TypeError as exc:
        raise ConfigError(f"task.params: {cls.__name__}(**params) failed: {exc}") from exc


@dataclass
class Run:
    """Everything one process needs to train and/or evaluate an experiment."""

    config: ExperimentConfig
    task: Task
    ctx: Context
    controller: Controller
    checkpoint_manager: CheckpointManager

    @property
    def model_dir(self) -> str:
        return self.config.model_dir


def build_run(cfg: ExperimentConfig, *, train: bool = True, evaluate: bool = True,
              restore_step: int | None = None, progress: bool | None = None) -> Run:
    """Seed, build the task and runners, and a controller that restores the latest checkpoint.

    ``train=False`` builds an evaluator-only run that reads checkpoints without changing the
    model directory (``restore_step``: that checkpoint; ``None``: the latest).
    """
    if not cfg.model_dir:
        raise ConfigError("model_dir: not set; give it in the config or with --model-dir")
    t = cfg.trainer
    seed_everything(t.seed)
    task = build_task(cfg)
    ctx = Context.create(device=t.device, seed=t.seed)
    trainer, evaluator = build_runners(
        task, ctx, precision=t.precision, grad_accum_steps=t.grad_accum_steps,
        grad_clip_norm=t.grad_clip_norm, train=train, evaluate=evaluate,
    )
    manager = CheckpointManager(
        layout.checkpoints_dir(cfg.model_dir), max_to_keep=t.max_to_keep,
        keep_every_n_steps=t.keep_every_n_steps, writer=train,
    )
    controller = Controller(
        trainer=trainer,
        evaluator=evaluator,
        checkpoint_manager=manager,
        steps_per_loop=t.steps_per_loop if train else None,
        checkpoint_interval=t.checkpoint_interval,
        summary_interval=t.summary_interval,
        summary_dir=layout.train_dir(cfg.model_dir) if train else None,
        eval_summary_dir=layout.eval_dir(cfg.model_dir) if train else None,
        restore_step=restore_step,
        progress=progress,
    )
    return Run(config=cfg, task=task, ctx=ctx, controller=controller, checkpoint_manager=manager)


def run_training(cfg: ExperimentConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """``train_and_evaluate`` the experiment in this process; return the last eval metrics.

    Writes the resolved ``config.yaml`` into the model dir and resumes from its latest
    checkpoint if it has one.
    """
    run = build_run(cfg, progress=progress)
    save_config(cfg, layout.config_path(cfg.model_dir))
    t = cfg.trainer
    with run.controller as controller:
        return controller.train_and_evaluate(
            train_steps=t.train_steps, eval_steps=t.validation_steps, eval_interval=t.validation_interval
        )


def run_evaluation(cfg: ExperimentConfig, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Evaluate checkpoint ``step`` (``None``: the latest); return ``(step, metrics)``.

    Raises:
      CheckpointError: the model dir has no committed checkpoint (or not that step).
    """
    run = build_run(cfg, train=False, restore_step=step, progress=False)
    if run.controller.restored_step is None:
        raise CheckpointError(
            f"no committed checkpoint in {layout.checkpoints_dir(cfg.model_dir)}: nothing to evaluate"
        )
    metrics = run.controller.evaluate(cfg.trainer.validation_steps)
    return run.controller.global_step, metrics
