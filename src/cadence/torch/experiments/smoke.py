"""Smoke test of an experiment config (``cadence smoke CONFIG``), like Determined's ``test=True``
and Lightning's ``fast_dev_run``: a minimal run of every part of the life cycle, in seconds.

:func:`run_smoke` runs these stages in order, each once, and reports each as ``ok``, ``failed``
(with the error) or ``skipped`` (every stage after the first failure):

* ``config``     the config resolves (written as ``config.yaml`` and read back equal), the task
                 class imports and instantiates;
* ``build``      :func:`~cadence.torch.experiments.run.build_run` builds the runners: model,
                 optimizer, LR scheduler, the configured actions and callbacks, the train inputs;
* ``train``      ``steps`` optimizer steps, each with a finite loss;
* ``evaluate``   one evaluation of at most :data:`EVAL_BATCHES` batches returns metrics;
* ``checkpoint`` one checkpoint commits (its ``MANIFEST.json`` written);
* ``restore``    a new run built from scratch with another seed (what a new process would do)
                 restores it: parameters and buffers (non-persistent ones too), optimizer, LR
                 scheduler and grad-scaler state and the global step equal the saved ones, and the
                 model's outputs on ``Task.example_inputs()`` (when defined) match;
* ``export``     the configured ``export.formats`` are written through
                 :class:`~cadence.torch.experiments.exporting.ModelExporter` (the code path of a real run)
                 and loaded back with :func:`~cadence.torch.export.api.load_exported`; their outputs on
                 the example inputs match the live model's (``safetensors``: its tensors match).
                 Without an ``export:`` section the stage passes as "no exports configured".

The run is forced small and single-process whatever the config says: a temporary model dir,
one step per inner loop, no interval checkpoints or evaluations, synchronous checkpoints, no
progress display, no sidecar. NaN recovery and saving on preemption are off (a non-finite loss is
what the ``train`` stage reports; Ctrl-C just stops the smoke test); exports are only written by
the ``export`` stage.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


import cadence
from cadence import layout
from cadence.config import ExperimentConfig, config_from_dict, load_config, save_config
from cadence.errors import ConfigError, one_line
from cadence.storage import unwritable_reason
from cadence.summaries.progress import format_value
from cadence.summaries.scalars import flatten_scalars
from cadence.units import format_size
from cadence.torch.experiments.smoke_checks import (
    SmokeCheckError,
    check_export,
    compare_modules,
    example_inputs_of,
    export_targets,
    first_difference,
    forward,
    max_diff,
    unwrapped,
)
from cadence.torch.export.formats import ExportOutputError
from cadence.torch.runtime.rng import get_rng_state, set_rng_state

__all__ = ["EVAL_BATCHES", "STAGES", "SmokeCheckError", "SmokeReport", "StageResult", "run_smoke"]

STAGES: tuple[str, ...] = ("config", "build", "train", "evaluate", "checkpoint", "restore", "export")
"""The stages of a smoke test, in the order they run."""
EVAL_BATCHES = 2
"""The most validation batches the ``evaluate`` stage runs (``trainer.validation_steps`` is capped)."""
EXPORT_NAME = "smoke"
"""The export stage writes to ``MODEL_DIR/export/smoke/<step>/``."""

Status = Literal["ok", "failed", "skipped"]



@dataclass
class StageResult:
    """One stage's outcome.

    ``status``: ``"ok"``, ``"failed"`` or ``"skipped"``. ``seconds``: its wall time (``None`` when
    skipped). ``detail``: a one-line summary of what it did (when ok). ``error``: ``"Type:
    message"`` (when failed). ``traceback``: the failure's traceback text, cadence's own leading
    frames trimmed; ``None`` for failed checks (:class:`SmokeCheckError`) and config errors,
    whose message says it all. ``exception``: the exception itself.
    """

    name: str
    status: Status
    seconds: float | None = None
    detail: str = ""
    error: str | None = None
    traceback: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class SmokeReport:
    """The stages' results, in :data:`STAGES` order. ``model_dir``: the kept model dir (``keep_dir``),
    or ``None`` when the temporary one was removed."""

    stages: list[StageResult]
    model_dir: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every stage passed."""
        return all(s.ok for s in self.stages)

    @property
    def failed(self) -> StageResult | None:
        """The failed stage, or ``None``."""
        return next((s for s in self.stages if s.status == "failed"), None)

    def stage(self, name: str) -> StageResult:
        """The result of stage ``name``; ``KeyError`` for a name not in :data:`STAGES`."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def statuses(self) -> dict[str, Status]:
        """``{stage name: status}``, in order."""
        return {s.name: s.status for s in self.stages}


def run_smoke(cfg: ExperimentConfig, *, steps: int = 2, keep_dir: str | None = None) -> SmokeReport:
    """Smoke-test ``cfg``: run the :data:`STAGES` once each on a small forced run; return the report.

    ``steps``: optimizer steps of the ``train`` stage (>= 1). ``keep_dir``: a local directory,
    new or empty, used as the model dir and kept afterwards (to look at the checkpoint and the
    exports); ``None``: a temporary directory (``tempfile.mkdtemp``), removed at the end. The
    config's own ``model_dir`` is never touched; the caller's global RNG states (Python, NumPy,
    torch) are restored afterwards. Errors of the run are reported in the stages, not raised.

    Raises:
      ValueError: ``steps`` < 1.
      ConfigError: ``keep_dir`` exists and is not an empty directory, or cannot be created or written.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if keep_dir is not None:
        keep = Path(keep_dir)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise ConfigError(f"--keep {keep_dir}: exists and is not an empty directory; give a new or empty one")
        why = unwritable_reason(keep_dir)  # a file on its path, a directory this process may not write
        if why is not None:
            raise ConfigError(f"--keep {keep_dir}: {why}")
        keep.mkdir(parents=True, exist_ok=True)
        model_dir = str(keep.resolve())
    else:
        model_dir = tempfile.mkdtemp(prefix="cadence-smoke-")
    smoke = _Smoke(cfg, model_dir, steps)
    start = time.perf_counter()
    results: list[StageResult] = []
    rng = get_rng_state()  # the run seeds the global RNGs: the caller's are given back
    try:
        for name in STAGES:
            if results and not results[-1].ok:
                results.append(StageResult(name, "skipped"))
                continue
            results.append(_run_stage(name, getattr(smoke, f"stage_{name}")))
    finally:
        smoke.close()
        set_rng_state(rng)
        if keep_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    return SmokeReport(results, model_dir=model_dir if keep_dir is not None else None,
                       seconds=time.perf_counter() - start)


def _run_stage(name: str, fn: Callable[[], str]) -> StageResult:
    start = time.perf_counter()
    try:
        detail = fn()
    except Exception as exc:  # noqa: BLE001 -- a stage's failure is the report's content; Ctrl-C is not
        tb = None if isinstance(exc, (SmokeCheckError, ConfigError, ExportOutputError)) else user_traceback(exc)
        return StageResult(name, "failed", time.perf_counter() - start, error=one_line(exc, all_lines=True), traceback=tb,
                           exception=exc)
    return StageResult(name, "ok", time.perf_counter() - start, detail=detail)


class _Smoke:
    """The stages, sharing the run they build; :meth:`close` releases whatever was built."""

    def __init__(self, cfg: ExperimentConfig, model_dir: str, steps: int) -> None:
        self.source = cfg
        self.model_dir = model_dir
        self.steps = steps
        # Set by the stages, in order (a stage runs only after those before it succeeded):
        self.cfg: ExperimentConfig  # the forced small config (stage_config)
        self.restore_cfg: ExperimentConfig  # the same with another seed (stage_config)
        self.step: int  # the checkpointed step (stage_checkpoint)
        self.run: Any = None
        self.restored: Any = None
        self._open: list[Any] = []  # the runs built and not closed yet, in order

    def close(self) -> None:
        while self._open:
            self._close(self._open[-1])
        self.run = self.restored = None

    def _close(self, run: Any) -> None:
        """Close ``run``'s controller, then release its writer lease; its model and optimizer stay."""
        self._open = [r for r in self._open if r is not run]
        with run:  # the writer lease goes after the controller closed
            run.controller.close()

    # -- stages ------------------------------------------------------------------------------

    def stage_config(self) -> str:
        from cadence.torch.experiments.task_loader import build_task

        data = self.source.to_dict()  # task.class made absolute: the run does not depend on the cwd
        data["model_dir"] = self.model_dir
        t = data["trainer"]
        t.update(
            train_steps=self.steps, steps_per_loop=1, checkpoint_interval=None, validation_interval=None,
            validation_steps=EVAL_BATCHES if t["validation_steps"] == -1 else min(t["validation_steps"], EVAL_BATCHES),
            summary_interval=None, max_to_keep=None, keep_every_n_steps=None, recovery=None,
            save_on_preemption=False, in_process_validation=True,
        )
        if t.get("lr_schedule") is not None:  # the same schedule, over the smoke run's steps
            t["lr_schedule"]["warmup_steps"] = min(t["lr_schedule"]["warmup_steps"], self.steps)
        data["checkpoint"] = {"async_save": False}
        data["loggers"] = {}  # a smoke run logs into no experiment tracker
        data["profiler"] = None  # nor traces its few steps
        data["sweep_trial"] = None  # nor reports to a sweep's study (a trial's config.yaml)
        data["eval_spec"] = {"throttle_secs": 0.0, "start_delay_secs": 0.0}
        if data.get("export") is not None:
            data["export"]["on"] = "final"  # no exporter action: the export stage exports, once
            data["export"]["max_to_keep"] = None
        config_dir = self.source.config_dir  # relative paths resolve as before
        self.cfg = config_from_dict(data, source="smoke config", config_dir=config_dir)
        t["seed"] = (int(t["seed"]) + 1) % 2**32  # a missed restore shows as different weights
        self.restore_cfg = config_from_dict(data, source="smoke config", config_dir=config_dir)
        path = layout.config_path(self.model_dir)
        save_config(self.cfg, path)
        if load_config(path) != self.cfg:
            raise SmokeCheckError(f"{path}: the resolved config does not read back equal to itself")
        task = build_task(self.cfg)
        return f"{type(task).__name__} from {self.cfg.task.class_path}"

    def stage_build(self) -> str:
        from cadence.torch.experiments.run import build_run

        self.run = build_run(self.cfg, progress=False)
        self._open.append(self.run)
        trainer = self.run.controller.trainer
        _ = trainer.train_data  # built now, as the first train loop would
        model = unwrapped(self.run.model)
        n = sum(p.numel() for p in model.parameters())
        scheduler = type(trainer.lr_scheduler).__name__ if trainer.lr_scheduler is not None else "no LR scheduler"
        return f"{n:,} parameters on {self.run.ctx.device}, {type(trainer.optimizer).__name__}, {scheduler}"

    def stage_train(self) -> str:
        controller = self.run.controller
        losses: list[float] = []

        def check_loss(logs: dict[str, Any]) -> None:  # one step per loop: the loss of that step
            loss = float(logs["loss"])
            if not math.isfinite(loss):
                raise SmokeCheckError(f"the training loss at step {controller.global_step} is {loss}")
            losses.append(loss)

        controller.train_actions.insert(0, check_loss)  # before the configured actions see it
        try:
            controller.train(self.steps, checkpoint_at_completion=False)
        finally:
            controller.train_actions.remove(check_loss)
        if controller.global_step != self.steps:
            why = f" (stopped: {controller.stop_reason})" if controller.stop_reason else ""
            raise SmokeCheckError(f"trained to global step {controller.global_step}, expected {self.steps}{why}")
        return f"{self.steps} step{'s' if self.steps > 1 else ''}, loss {format_value(losses[-1])}"

    def stage_evaluate(self) -> str:
        batches = self.cfg.trainer.validation_steps
        metrics = self.run.controller.evaluate(batches)
        metrics.pop("steps_per_second", None)  # the controller's rate (batches > 0): not one of the model's metrics
        if not metrics:
            raise SmokeCheckError("the evaluation returned no metrics")
        shown = " ".join(f"{k}={format_value(v)}" for k, v in flatten_scalars(metrics).items())  # val/loss=...
        return f"{shown} ({batches} batch{'es' if batches > 1 else ''} at most)"

    def stage_checkpoint(self) -> str:
        from cadence.checkpoint import MANIFEST_NAME

        controller, manager = self.run.controller, self.run.checkpoint_manager
        path = controller.save_checkpoint()
        self.step = controller.global_step
        if self.step not in manager.steps():
            raise SmokeCheckError(f"checkpoint {path} is not committed (no {MANIFEST_NAME})")
        info = manager.info(self.step)
        return f"ckpt-{self.step}: {info['files']} files, {format_size(info['size'])}, {MANIFEST_NAME} written"

    def stage_restore(self) -> str:
        from cadence.torch.experiments.run import build_run

        live = self.run.controller.trainer
        self._close(self.run)  # as a process that ended would: the new run takes a free writer lease
        self.restored = build_run(self.restore_cfg, progress=False)
        self._open.append(self.restored)
        controller = self.restored.controller
        if controller.restored_step != self.step:
            raise SmokeCheckError(f"a new run restored checkpoint {controller.restored_step}, expected {self.step}")
        new = controller.trainer
        if new.global_step != self.step:
            raise SmokeCheckError(f"the restored global step is {new.global_step}, expected {self.step}")
        compare_modules(unwrapped(live.model), unwrapped(new.model))
        checked = ["global step", "parameters", "buffers"]
        for what, a, b in (("optimizer", live.optimizer, new.optimizer),
                           ("LR scheduler", live.lr_scheduler, new.lr_scheduler),
                           ("grad scaler", live.grad_scaler, new.grad_scaler)):
            if (a is None) != (b is None):
                raise SmokeCheckError(f"{what}: the saved run has {'one' if a is not None else 'none'}, "
                                      f"the restored run {'one' if b is not None else 'none'}")
            if a is None:
                continue
            where = first_difference(a.state_dict(), b.state_dict(), f"{what} state")
            if where is not None:
                raise SmokeCheckError(f"{where} differs after restore (not in the checkpoint, or not loaded)")
            checked.append(what)
        inputs = example_inputs_of(self.run.task)
        if inputs is not None:
            device = self.run.ctx.device
            saved_out = forward(unwrapped(live.model), inputs, device)
            diff = max_diff(saved_out, forward(unwrapped(new.model), inputs, device))
            if diff is None or diff > 0:
                raise SmokeCheckError(
                    "the restored model's outputs on Task.example_inputs() differ from the saved model's "
                    + ("(different structure)" if diff is None else f"(max abs diff {diff:.3g})")
                    + ": some state affecting the outputs is not in the checkpoint"
                )
            checked.append("outputs")
        return f"step {self.step} restored by a new run: {', '.join(checked)} equal"

    def stage_export(self) -> str:
        from cadence.torch.experiments.exporting import ModelExporter

        if self.cfg.export is None:
            return "no exports configured (no export: section in the config)"
        run = self.run
        exporter = ModelExporter(self.cfg, run.task, run.model, EXPORT_NAME, chief=True)
        directory = exporter(self.step, {"smoke": True})
        if directory is None:  # the smoke test's own fresh model dir: never skipped
            raise RuntimeError("the export was skipped (see the warning)")
        done: list[str] = []
        with contextlib.closing(export_targets(run.task, unwrapped(run.model), directory)) as targets:
            for target in targets:  # the model stays in eval mode until the comparisons are done
                done += check_export(*target)
        return ", ".join(done)


_CADENCE_DIR = Path(cadence.__file__).resolve().parent


def _internal(frame: traceback.FrameSummary) -> bool:
    try:
        return Path(frame.filename).resolve().is_relative_to(_CADENCE_DIR)
    except (OSError, ValueError):
        return False


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback text, with cadence's own frames before the first other frame (the
    user's task, torch, ...) left out; the whole traceback when every frame is cadence's."""
    te = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    todo: list[traceback.TracebackException | None] = [te]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        frames = list(t.stack)
        first = next((i for i, f in enumerate(frames) if not _internal(f)), None)
        if first:  # None: all cadence's; 0: nothing to trim
            t.stack = traceback.StackSummary.from_list(frames[first:])
        todo += [t.__cause__, t.__context__]
    return "".join(te.format())
