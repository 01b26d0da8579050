"""External evaluators (``evaluators:``) on a Task's evaluations: :func:`with_external_evaluators` wraps
the torch evaluator so that each evaluation, after the built-in metrics, exports the evaluated weights
in the formats the commands name and runs them (:class:`~cadence.sidecar.external.ExternalEvaluators`).
Their metrics are part of the evaluation's: the summaries, the eval actions, the callbacks and the
sidecar's record see them as they see the built-in ones."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, Literal, Sequence

from cadence.checkpoint.protocol import CheckpointReader
from cadence.config import ExperimentConfig
from cadence.runtime.watchdog import unwatched
from cadence.sidecar.external import ExternalEvaluators, external_dir
from cadence.storage import local_path
from cadence.torch.components.ema import applied
from cadence.torch.experiments.exporting import example_inputs_for
from cadence.torch.loop.evaluator import TorchEvaluator
from cadence.torch.parallel import sharding
from cadence.torch.task.task import Task

__all__ = ["ExternallyEvaluated", "with_external_evaluators"]

Where = Literal["sidecar", "evaluate", "train"]


class ExternallyEvaluated:
    """A :class:`~cadence.torch.loop.evaluator.TorchEvaluator` whose :meth:`evaluate` also runs
    ``runner``'s commands on the evaluated weights; it restores checkpoints as the evaluator does.

    Only the chief exports and runs the commands (a sharded model is first gathered: a collective);
    with several ranks their metrics and report are then broadcast, so every rank's eval actions
    see the same metrics. ``expected``: the external metrics the eval actions read (their names):
    set to NaN when their command failed (a failed evaluation is no new best, and counts as no
    improvement for early stopping), and in the sanity check, which runs no command."""

    def __init__(self, evaluator: TorchEvaluator, runner: ExternalEvaluators, *, task: Task,
                 expected: Sequence[str] = ()) -> None:
        self.evaluator = evaluator
        self.runner = runner
        self.task = task
        self.expected = list(expected)
        self._loaded: tuple[int, str] | None = None
        self._report: dict[str, Any] | None = None
        self._paused = 0
        formats = runner.formats()
        self._example_inputs = {f: example_inputs_for(task, [f], "evaluators", evaluator.model) for f in formats}

    # -- what the controller and the run read of an evaluator -----------------------------------

    @property
    def model(self) -> Any:
        return self.evaluator.model

    @property
    def ema(self) -> Any:
        return self.evaluator.ema

    @property
    def global_step(self) -> int:
        return self.evaluator.global_step

    def load_checkpoint(self, reader: CheckpointReader, state: Any) -> None:
        self.evaluator.load_checkpoint(reader, state)
        self._loaded = (reader.step, reader.path)

    def external_report(self) -> dict[str, Any] | None:
        """What the commands of the last evaluation did, by evaluator name (None: none ran)."""
        return self._report

    @contextlib.contextmanager
    def without_external(self) -> Iterator[None]:
        """Evaluations inside run no command (the sanity check's)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def evaluate(self, num_steps: int = -1) -> dict[str, Any]:
        """The evaluator's metrics, then the commands' (``<prefix>/...``)."""
        metrics = dict(self.evaluator.evaluate(num_steps) or {})
        self._report = None
        if self._paused:
            return {**metrics, **self._missing({})}
        step = self.global_step
        checkpoint = self._loaded[1] if self._loaded is not None and self._loaded[0] == step else None
        ctx = self.evaluator.ctx
        full = self._gathered() if self.runner.formats() else None
        result: tuple[dict[str, Any], dict[str, Any]] | None = None
        if ctx.is_chief:
            with unwatched(ctx.heartbeat):  # a command may take long: no hang
                result = self.runner.run(step, checkpoint, lambda fmt, directory: self._export(full, fmt, directory, step))
        if ctx.world_size > 1 and ctx.coordinator is not None:
            result = ctx.coordinator.broadcast(result)
        assert result is not None
        external, self._report = result
        return {**metrics, **external, **self._missing(external)}

    def _missing(self, got: dict[str, Any]) -> dict[str, float]:
        return {name: math.nan for name in self.expected if name not in got}

    def _gathered(self) -> Any:
        """The evaluated module, unsharded (a collective on every rank when it is sharded)."""
        with applied(self.evaluator.ema):
            model = self.evaluator.model
            return sharding.full_copy(self.task.build_model, model) if sharding.is_sharded(model) else None

    def _export(self, full: Any, fmt: str, directory: str, step: int) -> None:
        from cadence.torch.export.api import export_task_model

        with applied(self.evaluator.ema):
            model = full if full is not None else self.evaluator.model
            export_task_model(self.task, model, directory, [fmt], example_inputs=self._example_inputs[fmt],
                              metadata={"step": step, "source": "evaluators"})


def _expected(cfg: ExperimentConfig, prefixes: list[str]) -> list[str]:
    """The metrics the eval actions read (best checkpoint, early stopping, a sweep trial's) that are
    under one of ``prefixes``."""
    t = cfg.trainer
    names = [m.metric for m in (t.best_checkpoint, t.early_stopping, cfg.sweep_trial) if m is not None]
    return [n for n in dict.fromkeys(names) if any(n.startswith(p + "/") for p in prefixes)]


def with_external_evaluators(cfg: ExperimentConfig, task: Task, evaluator: Any, where: Where,
                             eval_dir: str | None = None) -> Any:
    """``evaluator`` wrapped to run the ``evaluators:`` whose ``on`` holds ``where`` (itself when none
    does, or it is None). ``eval_dir``: the runs are kept under its ``external/`` (a local eval dir);
    ``None`` or a URL: in a temporary directory, deleted after each evaluation. The commands run in
    the current directory (the run's ``workdir``)."""
    specs = [s for s in cfg.evaluators if where in s.on]
    if not specs or evaluator is None:
        return evaluator
    work = local_path(external_dir(eval_dir)) if eval_dir is not None else None
    runner = ExternalEvaluators(specs, cfg.require_model_dir(), work_dir=work, cwd=os.getcwd())
    return ExternallyEvaluated(evaluator, runner, task=task, expected=_expected(cfg, [s.metric_prefix for s in specs]))

