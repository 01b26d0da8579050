"""Build a run from an :class:`~cadence.config.ExperimentConfig`: task, runners, checkpoint
manager and controller, laid out in the model directory (docs/design.md's contract).

This is what ``cadence train`` and ``cadence evaluate`` call; it is also the short way to run a
config from Python::

    from cadence.config import load_config
    from cadence.torch import run_training
    metrics = run_training(load_config("examples/digits/config.yaml", model_dir="runs/digits"))
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.writer_lease import WriterLease
from cadence.runtime.coordination import Coordinator, LocalCoordinator
from cadence.config import ExperimentConfig, save_config
from cadence.loop.controller import Controller
from cadence.errors import CheckpointError, ConfigError, WriterLeaseHeldError
from cadence.extensions import RunContext
from cadence.sidecar.evaluator import SidecarEvaluator, SidecarResult
from cadence.runtime.watchdog import Heartbeat, Watchdog
from cadence.torch.runtime.context import Context
from cadence.torch.components.ema import ModelEMA, applied
from cadence.torch.export.formats import TRACED_FORMATS, check_spec
from cadence.torch.task.export_specs import as_inputs
from cadence.torch.export.signatures import check_signatures, has_export_signatures
from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.runtime.rng import seed_everything
from cadence.torch.task.task import Task
from cadence.torch.parallel import sharding
from cadence.torch.loop.trainer import build_runners

logger = logging.getLogger("cadence")

__all__ = ["ModelExporter", "Run", "build_actions", "build_callbacks", "build_run", "build_sidecar", "build_task",
           "load_class", "load_task_class", "run_evaluation", "run_sidecar", "run_training"]


def load_class(spec: str, field: str) -> type:
    """Import the class named by ``module:ClassName`` or ``/path/to/file.py:ClassName``.

    A module is imported from ``sys.path`` (plus the current directory); a file is loaded once
    per process, with its directory put on ``sys.path`` so that it can import its siblings.
    ``ClassName`` may be dotted (``Outer.Inner``). ``field`` (e.g. ``task.class``,
    ``callbacks[0].class``) starts every error message.

    Raises:
      ConfigError: malformed spec, module or file not importable, no such class, not a class.
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
        raise ConfigError(f"{field}: cannot import module {module_name!r}: {exc}") from exc
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


def _instantiate(cls: type, params: Mapping[str, Any], field: str) -> Any:
    """``cls(**params)``; a constructor rejecting them raises ConfigError naming ``field``."""
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{field}: {cls.__name__}(**params) failed: {exc}") from exc


def build_task(cfg: ExperimentConfig) -> Task:
    """Instantiate the configured Task with ``task.params`` as keyword arguments."""
    return _instantiate(load_task_class(cfg.task.class_path), cfg.task.params, "task.params")


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
        callbacks.append(_instantiate(cls, entry.params, f"callbacks[{i}].params"))
    return callbacks


def _tracking(cfg: ExperimentConfig, chief: bool, *, eval_name: str | None = None,
              export: str | None = None) -> list[Any]:
    """The config's ``loggers:``, each tracker a callback (``[]``: none set; none on a rank that is
    not the chief): the evaluations under ``eval_name`` (default ``eval``), and at the end the
    newest export of ``export`` (the one this process writes). ConfigError when a tracker's extra
    is missing."""
    from cadence.trackers import build_trackers

    return list(build_trackers(cfg, chief=chief, eval_name=eval_name, export=export))


def _example_inputs(task: Task, formats: Sequence[str], where: str, model: Any = None) -> Any:
    """``task.example_inputs()`` when a format traces the model, else None.

    With ``model`` and a task whose ``export_signatures(model)`` returns signatures, those are
    checked instead (each signature brings its own example inputs) and the result is None.

    Raises:
      ConfigError: a traced format, and the task does not define ``example_inputs()``, or its
        ``export_spec()`` does not fit them; a signature with a bad name, without example inputs
        for a traced format, or with a spec that does not fit them (named).
    """
    if model is not None and has_export_signatures(task):
        try:
            signatures = check_signatures(task.export_signatures(unwrap_model(model)), formats)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {type(task).__name__}.export_signatures(): {exc}") from exc
        if signatures:
            return None
    needing = [f for f in formats if f in TRACED_FORMATS]
    if not needing:
        return None
    try:
        inputs = task.example_inputs()
    except NotImplementedError as exc:
        raise ConfigError(f"{where}: {needing} need {type(task).__name__}.example_inputs(), which is not defined") from exc
    try:
        check_spec(task.export_spec(), as_inputs(inputs) or ())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {type(task).__name__}.export_spec(): {exc}") from exc
    return inputs


class ModelExporter:
    """Writes the configured inference artefacts of the live model to ``export/<name>/<step>/``
    (with :meth:`Task.export_signatures`: one ``<signature>/`` subdirectory each, and
    ``signatures.json``) and keeps the newest ``export.max_to_keep`` steps. Only the chief
    writes (``chief``). Example inputs and signatures are checked when it is built (ConfigError).
    ``ema``: the weights exported are this EMA's (the evaluated ones), swapped in for the export."""

    def __init__(self, cfg: ExperimentConfig, task: Task, model: Any, name: str, *, chief: bool = True,
                 ema: ModelEMA | None = None) -> None:
        from cadence.actions import ExportFileManager

        assert cfg.export is not None
        self.formats = list(cfg.export.formats)
        self.model = model
        self.model_dir = cfg.require_model_dir()
        self.name = name
        self.task = task
        self.example_inputs = _example_inputs(task, self.formats, "export.formats", model)
        self.files = ExportFileManager(
            layout.export_dir(self.model_dir, name), max_to_keep=cfg.export.max_to_keep, separator="/"
        )
        self.chief = chief  # one process writes exports
        self.ema = ema

    def __call__(self, step: int, metadata: Mapping[str, Any]) -> str:
        """Export at ``step``; called on every rank. A model sharded by FSDP is first gathered
        (a collective) into a plain copy built by the task, on the chief's CPU."""
        from cadence.torch.export.api import export_task_model

        directory = layout.export_dir(self.model_dir, self.name, step)
        with applied(self.ema):
            model = self.model
            if sharding.is_sharded(model):
                model = sharding.full_copy(self.task.build_model, model)
            if not self.chief:
                return directory
            export_task_model(self.task, model, directory, self.formats, example_inputs=self.example_inputs,
                              metadata={**metadata, "step": step})
        self.files.clean_up()
        return directory


class ExportEveryEval:
    """An eval action: export after every evaluation, at the evaluated step."""

    def __init__(self, export: ModelExporter) -> None:
        self.export = export
        self._run: RunContext | None = None

    def attach(self, run: RunContext) -> None:
        self._run = run

    def __call__(self, metrics: dict[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError("ExportEveryEval must be attached to a Controller (pass it in eval_actions)")
        self.export(self._run.global_step, {"metrics": metrics})


def build_actions(cfg: ExperimentConfig, task: Task, model: Any, *, train: bool,
                  evaluate: bool = True, chief: bool = True, ema: ModelEMA | None = None) -> tuple[list, list]:
    """``(train_actions, eval_actions)`` from the config's ``trainer`` and ``export`` sections
    (``ema``: the exports are of its weights).

    Train actions (``train``): NaN/loss-spike recovery, a sweep trial's stop once pruned, then
    saving on preemption (last, so a preemption save sees the state after a recovery). Eval actions
    (``evaluate``): best-checkpoint export (and its inference export), exporting after every
    evaluation, early stopping (only with ``train``: a sidecar cannot stop the trainer), then a
    sweep trial's report to its Optuna trial (``sweep_trial``; the trainer's stops it when pruned).
    """
    from cadence.actions import BestCheckpointExporter, EarlyStopping, RecoveryAction, SaveCheckpointIfPreempted

    t = cfg.trainer
    train_actions: list[Any] = []
    eval_actions: list[Any] = []
    export_on = cfg.export.on if cfg.export is not None else None
    if train and t.recovery is not None:
        r = t.recovery
        train_actions.append(RecoveryAction(r.loss_upper_bound, r.recovery_begin_steps, r.max_trials))
    if train and cfg.sweep_trial is not None:  # a sidecar's (or an earlier run's) prune decision stops the trainer
        from cadence.sweep.pruning import StopWhenPruned

        train_actions.append(StopWhenPruned(cfg.require_model_dir()))
    if train and t.save_on_preemption:
        train_actions.append(SaveCheckpointIfPreempted())
    if not evaluate:
        return train_actions, eval_actions
    if t.best_checkpoint is not None:
        b = t.best_checkpoint
        export_fn = ModelExporter(cfg, task, model, "best", chief=chief, ema=ema) if export_on == "best" else None
        eval_actions.append(BestCheckpointExporter(layout.best_dir(cfg.require_model_dir()), b.metric, b.higher_is_better,
                                                   export_fn=export_fn))
    if export_on == "every_eval":
        eval_actions.append(ExportEveryEval(ModelExporter(cfg, task, model, "every_eval", chief=chief, ema=ema)))
    if train and t.early_stopping is not None:
        e = t.early_stopping
        eval_actions.append(EarlyStopping(e.metric, e.patience, e.min_delta, e.higher_is_better))
    if cfg.sweep_trial is not None:
        from cadence.sweep.pruning import ReportToTrial

        eval_actions.append(ReportToTrial.from_config(cfg.sweep_trial, cfg.require_model_dir(), stops=train))
    return train_actions, eval_actions


def _build_runners_for(cfg: ExperimentConfig, *, train: bool, evaluate: bool = True,
                       device: str | None = None, precision: str | None = None,
                       compile_model: bool = True) -> tuple[Task, Context, Any, Any]:
    """Seed, build the configured task, its context and runners: ``(task, ctx, trainer, evaluator)``.

    ``device`` / ``precision`` override ``trainer.device`` / ``trainer.precision``;
    ``compile_model=False`` ignores ``trainer.compile`` (an export only loads and traces).
    """
    t = cfg.trainer
    seed_everything(t.seed)
    task = build_task(cfg)
    ctx = Context.create(device=device or t.device, seed=t.seed)
    trainer, evaluator = build_runners(
        task, ctx, precision=precision or t.precision, grad_accum_steps=t.grad_accum_steps,
        grad_clip_norm=t.grad_clip_norm, train=train, evaluate=evaluate, strategy=t.strategy,
        lr_schedule=_lr_schedule(cfg), ema=t.ema,
        peak_tflops=t.peak_tflops, log_throughput=t.log_throughput, compile_config=t.compile if compile_model else None,
    )
    return task, ctx, trainer, evaluator


def _lr_schedule(cfg: ExperimentConfig) -> Callable[[Any], Any] | None:
    """``trainer.lr_schedule`` as a function of the optimizer (None: not set)."""
    schedule, total = cfg.trainer.lr_schedule, cfg.trainer.train_steps
    if schedule is None:
        return None
    assert total is not None, "checked by the schema"
    from cadence.torch.components.lr_schedule import build_lr_schedule

    return lambda optimizer: build_lr_schedule(optimizer, schedule, total_steps=total)


@dataclass
class Run:
    """Everything one process needs to train and/or evaluate an experiment."""

    config: ExperimentConfig
    task: Task
    ctx: Context
    controller: Controller
    checkpoint_manager: CheckpointManager
    model: Any
    writer_lease: WriterLease | None = None
    """The chief's writer lease on the model dir while it trains; None on other ranks and readers."""
    watchdog: Watchdog | None = None
    """This rank's hang watchdog while it trains (``trainer.hang_timeout``); None: off."""
    ema: ModelEMA | None = None
    """The EMA of the weights (``trainer.ema``): what is evaluated and exported; None: off."""

    @property
    def model_dir(self) -> str:
        return self.config.require_model_dir()

    def release(self) -> None:
        """Stop the watchdog and release the writer lease (the next trainer of the model dir may
        start at once); idempotent."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.writer_lease is not None:
            self.writer_lease.release()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def build_run(cfg: ExperimentConfig, *, train: bool = True, evaluate: bool = True,
              restore_step: int | None = None, progress: bool | None = None) -> Run:
    """Seed, build the task, runners, actions and callbacks (:func:`build_callbacks`), and a
    controller that restores the latest checkpoint.

    ``train=False`` builds an evaluator-only run that reads checkpoints without changing the
    model directory (``restore_step``: that checkpoint; ``None``: the latest); it runs no actions,
    and its callbacks hear of the restore, the evaluation and the close only.

    A training run's chief first takes the model dir's writer lease (:func:`acquire_writer_lease`;
    :class:`~cadence.errors.WriterLeaseHeldError` when another trainer holds it), which
    :attr:`Run.writer_lease` keeps until :meth:`Run.release` (``with run:``).
    """
    layout.check_model_dir(cfg.require_model_dir())
    task, ctx, trainer, evaluator = _build_runners_for(cfg, train=train, evaluate=evaluate)
    if trainer is not None:  # the training input now: a bad batch size fails before the model dir is written
        _ = trainer.train_data
    lease = acquire_writer_lease(cfg, ctx.coordinator) if train else None
    watchdog = None
    if train and cfg.trainer.hang_timeout is not None:  # from before the restore (a collective that may hang)
        ctx.heartbeat = Heartbeat()
        watchdog = Watchdog(ctx.heartbeat, cfg.trainer.hang_timeout, rank=ctx.rank).start()
    try:
        run = _assemble_run(cfg, task, ctx, trainer, evaluator, lease, train=train, evaluate=evaluate,
                            restore_step=restore_step, progress=progress)
    except BaseException:
        if watchdog is not None:
            watchdog.stop()
        if lease is not None:
            lease.release()
        raise
    run.watchdog = watchdog
    return run


def acquire_writer_lease(cfg: ExperimentConfig, coordinator: Coordinator | None) -> WriterLease | None:
    """The chief's writer lease on the model dir (None on the other ranks, which never commit).

    A collective: the chief acquires; when it cannot, every rank raises the same
    :class:`~cadence.errors.WriterLeaseHeldError`, so the whole job stops before writing anything.
    """
    coordinator = coordinator or LocalCoordinator()
    lease, refusal = None, None
    if coordinator.is_chief:
        try:
            lease = WriterLease.acquire(cfg.require_model_dir(), ttl=cfg.checkpoint.writer_lease_ttl)
        except WriterLeaseHeldError as e:
            refusal = str(e)
    refusal = coordinator.broadcast(refusal)
    if refusal is not None:
        raise WriterLeaseHeldError(refusal)
    return lease


def _assemble_run(cfg: ExperimentConfig, task: Task, ctx: Context, trainer: Any, evaluator: Any,
                  lease: WriterLease | None, *, train: bool, evaluate: bool, restore_step: int | None,
                  progress: bool | None) -> Run:
    model_dir = cfg.require_model_dir()
    t = cfg.trainer
    model = (trainer or evaluator).model
    ema = (trainer or evaluator).ema
    train_actions, eval_actions = (
        build_actions(cfg, task, model, train=train, evaluate=evaluate, chief=ctx.is_chief, ema=ema)
        if train else ([], [])
    )
    callbacks = build_callbacks(cfg, task)
    if train:  # a one-off evaluation (cadence evaluate --checkpoint) logs into no tracker
        export_on = cfg.export.on if cfg.export is not None else None
        exports = export_on if export_on == "final" or (evaluate and export_on is not None) else None
        callbacks += _tracking(cfg, ctx.is_chief, export=exports)
    if train and ema is not None:  # updated after each step (after the user's callbacks: their positions stay)
        callbacks.append(ema)
    if train and cfg.profiler is not None:
        from cadence.torch.components.profiling import build_step_profiler

        callbacks.append(build_step_profiler(cfg.profiler, model_dir, ctx, train_steps=t.train_steps))
    manager = CheckpointManager(  # one writer: the chief; the other ranks only read
        layout.checkpoints_dir(model_dir), max_to_keep=t.max_to_keep,
        keep_every_n_steps=t.keep_every_n_steps, writer=train and ctx.is_chief,
        async_save=cfg.checkpoint.async_save and train, fence=lease, checksum=cfg.checkpoint.checksum,
    )
    controller = Controller(
        trainer=trainer,
        evaluator=evaluator,
        checkpoint_manager=manager,
        steps_per_loop=t.steps_per_loop if train else None,
        checkpoint_interval=t.checkpoint_interval,
        summary_interval=t.summary_interval,
        summary_dir=layout.train_dir(model_dir) if train else None,
        eval_summary_dir=layout.eval_dir(model_dir) if train else None,
        train_actions=train_actions,
        eval_actions=eval_actions,
        callbacks=callbacks,
        restore_step=restore_step,
        progress=progress,
        coordinator=ctx.coordinator,
        heartbeat=ctx.heartbeat,
    )
    return Run(config=cfg, task=task, ctx=ctx, controller=controller, checkpoint_manager=manager, model=model,
               writer_lease=lease, ema=ema)


def run_training(cfg: ExperimentConfig, *, progress: bool | None = None,
                 in_process_validation: bool | None = None) -> dict[str, Any]:
    """``train_and_evaluate`` the experiment in this process; return the last eval metrics.

    Resumes from the model dir's latest checkpoint if it has one, and writes the resolved
    ``config.yaml`` into it when there is something to train.
    First, ``trainer.sanity_val_steps`` validation batches check the
    validation code and the eval metrics the actions name (:func:`~cadence.loop.sanity.sanity_check`;
    a :class:`~cadence.errors.SanityCheckError` before any step). With ``export.on: final``,
    exports the final model. ``in_process_validation`` (default: ``trainer.in_process_validation``): False only trains,
    for a sidecar to evaluate; the result is then ``{}``.
    """
    if in_process_validation is None:
        in_process_validation = cfg.trainer.in_process_validation
    if not in_process_validation:
        return _train_only(cfg, progress)
    run = build_run(cfg, progress=progress)
    export_final = (
        ModelExporter(cfg, run.task, run.model, "final", chief=run.ctx.is_chief, ema=run.ema)
        if cfg.export is not None and cfg.export.on == "final" else None
    )
    _save_config_if_training(cfg, run)
    t = cfg.trainer
    sanity_steps = t.sanity_val_steps if t.validation_steps == -1 else min(t.sanity_val_steps, t.validation_steps)
    with run, run.controller as controller:  # the controller closes (commits) before the lease goes
        metrics = controller.train_and_evaluate(
            train_steps=t.train_steps, eval_steps=t.validation_steps, eval_interval=t.validation_interval,
            throttle_secs=cfg.eval_spec.throttle_secs, start_delay_secs=cfg.eval_spec.start_delay_secs,
            sanity_steps=sanity_steps,
        )
        if export_final is not None:
            if run.watchdog is not None:  # training is over and committed: a long export is no hang
                run.watchdog.stop()
            export_final(controller.global_step, {"metrics": metrics})
    return metrics


def _train_only(cfg: ExperimentConfig, progress: bool | None) -> dict[str, Any]:
    """Train without evaluating (a sidecar evaluates the checkpoints); FINAL marks the end."""
    if cfg.trainer.checkpoint_interval is None:
        logger.warning("trainer.checkpoint_interval is null: a sidecar will only see the final checkpoint")
    run = build_run(cfg, evaluate=False, progress=progress)
    _save_config_if_training(cfg, run)
    with run, run.controller as controller:
        controller.train(cfg.trainer.train_steps)
    return {}


def _save_config_if_training(cfg: ExperimentConfig, run: Run) -> None:
    """Write the resolved ``config.yaml`` into the model dir when the run will train, before its
    first checkpoint; a model dir restored at ``trainer.train_steps`` or past it (nothing to
    train) keeps the config it was trained with."""
    steps = cfg.trainer.train_steps
    if steps is None or run.controller.global_step < steps:
        save_config(cfg, layout.config_path(cfg.require_model_dir()))


def build_sidecar(cfg: ExperimentConfig) -> SidecarEvaluator:
    """A :class:`~cadence.sidecar.evaluator.SidecarEvaluator` for the experiment: the task's torch
    evaluator, the ``sidecar:`` settings, the configured eval actions (best checkpoint and its
    export, export on every evaluation) and callbacks (:func:`build_callbacks`). Early stopping
    needs the trainer's loop and is ignored here, with a warning."""
    model_dir = layout.check_model_dir(cfg.require_model_dir())
    t = cfg.trainer
    task, ctx, _, evaluator = _build_runners_for(cfg, train=False)
    _, eval_actions = build_actions(cfg, task, evaluator.model, train=False, chief=ctx.is_chief, ema=evaluator.ema)
    callbacks = build_callbacks(cfg, task)
    export_on = cfg.export.on if cfg.export is not None else None
    callbacks += _tracking(cfg, ctx.is_chief, eval_name=layout.eval_dir(model_dir, cfg.sidecar.name).rsplit("/", 1)[-1],
                           export=export_on if export_on in ("best", "every_eval") else None)
    if t.early_stopping is not None:
        logger.warning("trainer.early_stopping is ignored by the sidecar: only an in-process evaluation can stop training")
    best = t.best_checkpoint
    return SidecarEvaluator(
        evaluator, model_dir, steps=t.validation_steps, eval_actions=eval_actions, train_steps=t.train_steps,
        best_metric=best.metric if best else None, higher_is_better=best.higher_is_better if best else True,
        callbacks=callbacks, **cfg.sidecar.model_dump(),
    )


def run_sidecar(cfg: ExperimentConfig) -> SidecarResult:
    """Run the experiment's sidecar evaluator until it stops (``cadence evaluate --continuous``,
    the evaluator role); return what it did and why it stopped."""
    return build_sidecar(cfg).start()


def run_evaluation(cfg: ExperimentConfig, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Evaluate checkpoint ``step`` (``None``: the latest); return ``(step, metrics)``.

    Raises:
      CheckpointError: the model dir has no committed checkpoint (or not that step).
    """
    run = build_run(cfg, train=False, restore_step=step, progress=False)
    with run.controller as controller:
        if controller.restored_step is None:
            raise CheckpointError(
                f"no committed checkpoint in {layout.checkpoints_dir(cfg.require_model_dir())}: nothing to evaluate"
            )
        metrics = controller.evaluate(cfg.trainer.validation_steps)
        return controller.global_step, metrics


def run_export(model_dir: str, formats: list[str], checkpoint: str = "best",
               out: str | None = None) -> tuple[int, str, dict[str, str]]:
    """Export a checkpoint of a model dir as inference artefacts; return ``(step, directory, files)``.

    The model is built from the model dir's resolved ``config.yaml``. ``checkpoint``: ``"best"``
    (``best/``), ``"latest"`` (the newest committed in ``checkpoints/``) or a step number.
    ``out``: the directory to write; default ``export/best/<step>/`` for the best checkpoint and
    ``export/checkpoint/<step>/`` otherwise. ``files``: ``{format: path}``; for a task with
    :meth:`Task.export_signatures`, ``{"<signature>/<format>": path}`` (one subdirectory of
    ``directory`` per signature, and ``signatures.json``). With ``trainer.ema`` in the model dir's
    config, the checkpoint's EMA weights are exported (the evaluated ones).

    Raises:
      CadenceError: not a model dir (no ``config.yaml``), or no such checkpoint.
      ConfigError: a format that needs ``Task.example_inputs()`` the task does not define; a bad
        signature name, or a signature without the example inputs a format needs.
    """
    from cadence.config import load_config
    from cadence.errors import CadenceError
    from cadence.storage import Storage
    from cadence.torch.export.api import export_task_model

    config_file = layout.config_path(model_dir)
    if not Storage(config_file).exists(Storage(config_file).root):
        raise CadenceError(f"{config_file} not found: {model_dir} is not a cadence model dir (or was never trained)")
    cfg = load_config(config_file, model_dir=model_dir)
    task, _, _, evaluator = _build_runners_for(cfg, train=False, device="cpu", precision="32", compile_model=False)
    if checkpoint == "best":
        manager = CheckpointManager(layout.best_dir(model_dir), writer=False)
        if manager.latest_step() is None:
            raise CheckpointError(f"no best checkpoint in {layout.best_dir(model_dir)} (set trainer.best_checkpoint)")
        step = None
    else:
        manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False)
        step = None if checkpoint == "latest" else int(checkpoint)
    restored = manager.restore({"evaluator": evaluator}, step)
    if restored is None:
        raise CheckpointError(f"no committed checkpoint in {manager.directory}")
    example_inputs = _example_inputs(task, formats, "--format", evaluator.model)
    directory = out or layout.export_dir(model_dir, "best" if checkpoint == "best" else "checkpoint", restored)
    with applied(evaluator.ema):  # the evaluated weights: the EMA's with trainer.ema
        files = export_task_model(task, evaluator.model, directory, formats, example_inputs=example_inputs,
                                  metadata={"step": restored, "source": manager.path(restored)})
    return restored, directory, files
