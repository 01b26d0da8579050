"""Smoke test of an experiment config (``cadence smoke CONFIG``), like Determined's ``test=True``
and Lightning's ``fast_dev_run``: a minimal run of every part of the life cycle, in seconds.

:func:`run_smoke` runs these stages in order, each once, and reports each as ``ok``, ``failed``
(with the error) or ``skipped`` (every stage after the first failure):

* ``config``     the config resolves (written as ``config.yaml`` and read back equal), the task
                 class imports and instantiates;
* ``build``      :func:`~cadence.torch.experiment.build_run` builds the runners: model,
                 optimizer, LR scheduler, the configured actions and callbacks, the train inputs;
* ``train``      ``steps`` optimizer steps, each with a finite loss;
* ``evaluate``   one evaluation of at most :data:`EVAL_BATCHES` batches returns metrics;
* ``checkpoint`` one checkpoint commits (its ``MANIFEST.json`` written);
* ``restore``    a new run built from scratch with another seed (what a new process would do)
                 restores it: parameters and buffers (non-persistent ones too), optimizer, LR
                 scheduler and grad-scaler state and the global step equal the saved ones, and the
                 model's outputs on ``Task.example_inputs()`` (when defined) match;
* ``export``     the configured ``export.formats`` are written through
                 :class:`~cadence.torch.experiment.ModelExporter` (the code path of a real run)
                 and loaded back with :func:`~cadence.torch.export.load_exported`; their outputs on
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
import copy
import math
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

import cadence
from cadence import layout
from cadence.config import ExperimentConfig, config_from_dict, load_config, save_config
from cadence.errors import CadenceError, ConfigError
from cadence.progress import format_size, format_value
from cadence.torch.state import get_rng_state, set_rng_state

__all__ = ["EVAL_BATCHES", "STAGES", "SmokeCheckError", "SmokeReport", "StageResult", "run_smoke"]

STAGES: tuple[str, ...] = ("config", "build", "train", "evaluate", "checkpoint", "restore", "export")
"""The stages of a smoke test, in the order they run."""
EVAL_BATCHES = 2
"""The most validation batches the ``evaluate`` stage runs (``trainer.validation_steps`` is capped)."""
EXPORT_NAME = "smoke"
"""The export stage writes to ``MODEL_DIR/export/smoke/<step>/``."""

Status = Literal["ok", "failed", "skipped"]
_EXPORT_RTOL = 1e-4  # exported graphs may fuse or reorder float ops
_EXPORT_ATOL = 1e-5


class SmokeCheckError(CadenceError):
    """A smoke-test check found something wrong (a NaN loss, a state not restored, an export
    whose outputs differ); the message says what. Raised inside a stage, never by :func:`run_smoke`."""


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
      ConfigError: ``keep_dir`` exists and is not an empty directory.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if keep_dir is not None:
        keep = Path(keep_dir)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise ConfigError(f"--keep {keep_dir}: exists and is not an empty directory; give a new or empty one")
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
        tb = None if isinstance(exc, (SmokeCheckError, ConfigError)) else user_traceback(exc)
        return StageResult(name, "failed", time.perf_counter() - start, error=_one_line(exc), traceback=tb,
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

    def close(self) -> None:
        for run in (self.restored, self.run):
            if run is not None:
                run.controller.close()
        self.run = self.restored = None

    # -- stages ------------------------------------------------------------------------------

    def stage_config(self) -> str:
        from cadence.torch.experiment import build_task

        data = self.source.to_dict()  # task.class made absolute: the run does not depend on the cwd
        data["model_dir"] = self.model_dir
        t = data["trainer"]
        t.update(
            train_steps=self.steps, steps_per_loop=1, checkpoint_interval=None, validation_interval=None,
            validation_steps=EVAL_BATCHES if t["validation_steps"] == -1 else min(t["validation_steps"], EVAL_BATCHES),
            summary_interval=None, max_to_keep=None, keep_every_n_steps=None, recovery=None,
            save_on_preemption=False, in_process_validation=True,
        )
        data["checkpoint"] = {"async_save": False}
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
        from cadence.torch.experiment import build_run

        self.run = build_run(self.cfg, progress=False)
        trainer = self.run.controller.trainer
        _ = trainer.train_data  # built now, as the first train loop would
        model = _module(self.run.model)
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
        if not metrics:
            raise SmokeCheckError("the evaluation returned no metrics")
        shown = " ".join(f"{k}={format_value(v)}" for k, v in metrics.items())
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
        from cadence.torch.experiment import build_run

        live = self.run.controller.trainer
        self.restored = build_run(self.restore_cfg, progress=False)
        controller = self.restored.controller
        if controller.restored_step != self.step:
            raise SmokeCheckError(f"a new run restored checkpoint {controller.restored_step}, expected {self.step}")
        new = controller.trainer
        if new.global_step != self.step:
            raise SmokeCheckError(f"the restored global step is {new.global_step}, expected {self.step}")
        _compare_modules(_module(live.model), _module(new.model))
        checked = ["global step", "parameters", "buffers"]
        for what, a, b in (("optimizer", live.optimizer, new.optimizer),
                           ("LR scheduler", live.lr_scheduler, new.lr_scheduler),
                           ("grad scaler", live.grad_scaler, new.grad_scaler)):
            if (a is None) != (b is None):
                raise SmokeCheckError(f"{what}: the saved run has {'one' if a is not None else 'none'}, "
                                      f"the restored run {'one' if b is not None else 'none'}")
            if a is None:
                continue
            where = _first_difference(a.state_dict(), b.state_dict(), f"{what} state")
            if where is not None:
                raise SmokeCheckError(f"{where} differs after restore (not in the checkpoint, or not loaded)")
            checked.append(what)
        inputs = _example_inputs(self.run.task)
        if inputs is not None:
            device = self.run.ctx.device
            saved_out = _forward(_module(live.model), inputs, device)
            diff = _max_diff(saved_out, _forward(_module(new.model), inputs, device))
            if diff is None or diff > 0:
                raise SmokeCheckError(
                    "the restored model's outputs on Task.example_inputs() differ from the saved model's "
                    + ("(different structure)" if diff is None else f"(max abs diff {diff:.3g})")
                    + ": some state affecting the outputs is not in the checkpoint"
                )
            checked.append("outputs")
        return f"step {self.step} restored by a new run: {', '.join(checked)} equal"

    def stage_export(self) -> str:
        from cadence.torch.experiment import ModelExporter

        if self.cfg.export is None:
            return "no exports configured (no export: section in the config)"
        run = self.run
        exporter = ModelExporter(self.cfg, run.task, run.model, EXPORT_NAME, chief=True)
        directory = exporter(self.step, {"smoke": True})
        done: list[str] = []
        with contextlib.closing(_export_targets(run.task, _module(run.model), directory)) as targets:
            for target in targets:  # the model stays in eval mode until the comparisons are done
                done += _check_export(*target)
        return ", ".join(done)


def _check_export(label: str, directory: str, live: Any, inputs: Any, weights: nn.Module) -> list[str]:
    """Load each format of the export in ``directory`` and compare it with the live model: the
    tensors for ``safetensors``, the outputs on ``inputs`` (when given) for the others."""
    from cadence.torch.export import load_exported, read_export_metadata

    expected = _forward(live, inputs, _device_of(live)) if inputs is not None else None
    done = []
    for fmt in read_export_metadata(directory).get("formats", {}):
        loaded = load_exported(directory, fmt)
        if fmt == "safetensors":
            where = _first_difference(weights.state_dict(), loaded, "model.safetensors")
            if where is not None:
                raise SmokeCheckError(f"export {label}{fmt}: {where} differs from the live model")
            done.append(f"{label}{fmt} tensors equal")
        elif expected is None:
            done.append(f"{label}{fmt} loaded")
        else:
            diff = _max_diff(expected, _run_exported(fmt, loaded, inputs), rtol=_EXPORT_RTOL, atol=_EXPORT_ATOL)
            if diff is None:
                raise SmokeCheckError(f"export {label}{fmt}: its outputs on the example inputs do not match "
                                      "the live model's in number or shape")
            if diff > 0:
                raise SmokeCheckError(f"export {label}{fmt}: its outputs on the example inputs differ from "
                                      f"the live model's beyond tolerance (max abs diff {diff:.3g})")
            done.append(f"{label}{fmt} outputs match")
    return done


def _export_targets(task: Any, model: nn.Module, directory: str) -> Generator[tuple[str, str, Any, Any, nn.Module]]:
    """What to check in the export at ``directory``: ``(label, export dir, live callable, its example
    inputs or None, the module whose state dict the safetensors artefact holds)``; one per signature
    (``Task.export_signatures``, rebuilt here on a CPU copy of the model as the export did), else one."""
    from cadence.torch.export_formats import METADATA_FILE, SIGNATURES_FILE
    from cadence.torch.signatures import ExportSignature, read_signatures

    if os.path.exists(os.path.join(directory, METADATA_FILE)):
        yield "", directory, model, _example_inputs(task), model
        return
    if not os.path.exists(os.path.join(directory, SIGNATURES_FILE)):
        raise SmokeCheckError(f"no complete export under {directory} (neither {METADATA_FILE} nor {SIGNATURES_FILE})")
    cpu = model if all(t.device.type == "cpu" for t in model.state_dict().values()) else copy.deepcopy(model).cpu()
    modes = [(m, m.training) for m in cpu.modules()]
    try:
        cpu.eval()
        signatures = dict(task.export_signatures(cpu))
        listed = read_signatures(directory)["signatures"]
        for name, entry in listed.items():
            sig = signatures.get(name)
            if not isinstance(sig, ExportSignature):
                raise SmokeCheckError(f"signatures.json lists {name!r}, which Task.export_signatures() does not return")
            live = sig.module
            weights = live if isinstance(live, nn.Module) else cpu
            yield f"{name}/", os.path.join(directory, entry.get("directory", name)), live, sig.example_inputs, weights
    finally:
        for m, training in modes:
            m.training = training


# -- comparisons -------------------------------------------------------------------------------


def _module(model: nn.Module) -> nn.Module:
    from cadence.torch.state import unwrap_model

    return unwrap_model(model)


def _compare_modules(saved: nn.Module, restored: nn.Module) -> None:
    """Parameters and all buffers (non-persistent ones too, which a checkpoint does not hold) equal."""
    for kind, a, b in (("parameter", dict(saved.named_parameters()), dict(restored.named_parameters())),
                       ("buffer", dict(saved.named_buffers()), dict(restored.named_buffers()))):
        if a.keys() != b.keys():
            missing, extra = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
            raise SmokeCheckError(f"the restored model's {kind}s differ in name: only saved {missing}, "
                                  f"only restored {extra}")
        for name in a:
            if not _tensors_equal(a[name], b[name]):
                unsaved = kind == "buffer" and name not in saved.state_dict()
                hint = " (not in the checkpoint: a non-persistent buffer?)" if unsaved else ""
                raise SmokeCheckError(f"{kind} {name!r} differs between the saved and the restored model{hint}")


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The path of the first value that differs between two nested states, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
        return None if ok else path
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return f"{path} (keys {sorted(map(str, set(a) ^ set(b)))} in one only)"
        for k in a:
            where = _first_difference(a[k], b[k], f"{path}[{k!r}]")
            if where is not None:
                return where
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            where = _first_difference(x, y, f"{path}[{i}]")
            if where is not None:
                return where
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else path


def _example_inputs(task: Any) -> tuple[Any, ...] | None:
    """``task.example_inputs()`` as a tuple, or None when the task does not define it."""
    try:
        inputs = task.example_inputs()
    except NotImplementedError:
        return None
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _forward(fn: Any, inputs: tuple[Any, ...], device: Any) -> list[torch.Tensor]:
    """``fn(*inputs)`` (a module in eval mode) without grad, RNG forked and seeded (a sampling model
    gives the same outputs each time); the output tensors flattened, on CPU. Modes are restored."""
    from cadence.torch.batch import move_to_device

    modes = [(m, m.training) for m in fn.modules()] if isinstance(fn, nn.Module) else []
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    try:
        if isinstance(fn, nn.Module):
            fn.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            out = fn(*move_to_device(tuple(inputs), device))
    finally:
        for m, training in modes:
            m.training = training
    return [t.detach().cpu() for t in _leaves(out)]


def _device_of(fn: Any) -> torch.device:
    """Where a module's tensors are (CPU for a plain callable or a module without tensors)."""
    if isinstance(fn, nn.Module):
        for t in (*fn.parameters(), *fn.buffers()):
            return t.device
    return torch.device("cpu")


def _leaves(out: Any) -> Iterator[Any]:
    if isinstance(out, Mapping):
        for v in out.values():
            yield from _leaves(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _leaves(v)
    elif isinstance(out, torch.Tensor):
        yield out
    else:  # numpy arrays (onnxruntime)
        yield torch.as_tensor(out)


def _run_exported(fmt: str, loaded: Any, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    cpu = tuple(x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in inputs)
    if fmt == "onnx":
        tensors = [x for x in cpu if isinstance(x, torch.Tensor)]
        feeds = {i.name: x.numpy() for i, x in zip(loaded.get_inputs(), tensors)}
        return list(_leaves(loaded.run(None, feeds)))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [t.detach().cpu() for t in _leaves(loaded(*cpu))]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor], *, rtol: float = 0.0, atol: float = 0.0) -> float | None:
    """0.0 when every pair is within ``atol + rtol * |a|``; else the largest absolute difference;
    None when the outputs differ in number or shape."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if x.dtype.is_floating_point or y.dtype.is_floating_point:
            x, y = x.double(), y.double()
            if torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                continue
            worst = max(worst, float((x - y).abs().nan_to_num(nan=math.inf).max()))
        elif not torch.equal(x, y.to(x.dtype)):
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


# -- text --------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # multi-line messages (config errors) on one line
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
