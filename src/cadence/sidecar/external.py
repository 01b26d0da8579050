"""External evaluators: the commands of the config's ``evaluators:`` run on one evaluated checkpoint
(:class:`ExternalEvaluators`), their JSON results turned into metrics, their failures into a record.

An evaluator that runs them says what they did through :class:`ReportsExternal`; the continuous
evaluation puts that into the step's record (``evaluations.jsonl``: ``external.<name>``). Each
command runs without a shell, in a session of its own (a timeout kills its whole process group) that
ends with this process (``PR_SET_PDEATHSIG``: a sidecar killed while a command runs leaves no
orphan; it runs the command again after its restart, as the step was never recorded). Exporting the
weights is the framework's: the caller passes ``export(format, directory)``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from cadence import layout
from cadence.config.components.external_evaluators import ExternalEvaluatorConfig
from cadence.runtime.parent_death import parent_death_signal_setter
from cadence.sidecar.external_results import ResultError, command_argv, last_line, read_result, render, to_metrics

__all__ = ["Attempt", "ExternalEvaluators", "ReportsExternal", "RunsExternal", "external_dir"]

logger = logging.getLogger("cadence.sidecar.external")

Export = Callable[[str, str], None]
"""``export(format, directory)``: write the evaluated weights in ``format`` into the new ``directory``."""
_KILL_WAIT_S = 10.0


@runtime_checkable
class ReportsExternal(Protocol):
    """An evaluator whose last evaluation ran external commands: what each did, by name
    (``{"status": "ok" | "failed" | "timeout", "exit", "last_line", "attempts", "duration_s"}``),
    or None when none ran."""

    def external_report(self) -> dict[str, dict[str, Any]] | None: ...


@runtime_checkable
class RunsExternal(ReportsExternal, Protocol):
    """An evaluator that runs external commands, and evaluates without them inside
    ``without_external()`` (the sanity check before training)."""

    def without_external(self) -> AbstractContextManager[None]: ...


def external_dir(eval_dir: str) -> str:
    """Where the commands' runs go: ``<eval dir>/external/`` (``<name>/<step>/``)."""
    return layout.join(eval_dir, "external")


@dataclass
class Attempt:
    """One run of a command: its exit status (None: killed at its timeout), output, and time."""

    exit: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def timed_out(self) -> bool:
        return self.exit is None


class ExternalEvaluators:
    """Runs ``specs`` on one checkpoint at a time (:meth:`run`).

    Args:
      specs: the ``evaluators:`` entries to run (already chosen for this kind of evaluation).
      model_dir: ``{model_dir}``.
      work_dir: a local directory (a path) holding the runs (``<name>/<step>/``: ``output/`` is ``{output_dir}``,
        beside ``stdout.txt`` and ``stderr.txt``) and the exports while they are used; ``None``: a
        temporary directory of each :meth:`run`, deleted after it (nothing is kept).
      cwd: the commands' working directory (``None``: this process's).
    """

    def __init__(self, specs: Sequence[ExternalEvaluatorConfig], model_dir: str, work_dir: str | None = None,
                 cwd: str | None = None) -> None:
        self.specs = list(specs)
        self.model_dir = model_dir
        self.work_dir = None if work_dir is None else os.path.abspath(work_dir)
        self.cwd = cwd

    def formats(self) -> list[str]:
        """The export formats the commands need (no ``none``), in order."""
        return list(dict.fromkeys(s.format for s in self.specs if s.format != "none"))

    def run(self, step: int, checkpoint_dir: str | None, export: Export) -> tuple[dict[str, float], dict[str, Any]]:
        """Export the formats the commands need, run each command (retried as its spec says), delete
        the exports; return ``(metrics, report)``: every command's metrics (``<prefix>/...``), and
        per name what it did (:class:`ReportsExternal`). A command that fails, or whose export failed
        (logged with its traceback; the command does not run), is in the report only."""
        if self.work_dir is None:
            with tempfile.TemporaryDirectory(prefix="cadence-external-") as tmp:
                return self._run(tmp, step, checkpoint_dir, export)
        os.makedirs(self.work_dir, exist_ok=True)
        return self._run(self.work_dir, step, checkpoint_dir, export)

    def _run(self, work: str, step: int, checkpoint_dir: str | None, export: Export) -> tuple[dict[str, float], dict[str, Any]]:
        exports = {fmt: os.path.join(work, f".export-{fmt}-{step}") for fmt in self.formats()}
        metrics: dict[str, float] = {}
        report: dict[str, Any] = {}
        failed_exports: dict[str, str] = {}
        try:
            for fmt, directory in exports.items():
                shutil.rmtree(directory, ignore_errors=True)  # a killed run's
                try:
                    export(fmt, directory)
                except Exception as e:  # noqa: BLE001 - its commands fail, the evaluation goes on
                    logger.exception("evaluators: exporting step %d as %s failed", step, fmt)
                    failed_exports[fmt] = f"exporting the weights as {fmt} failed: {type(e).__name__}: {e}"
            for spec in self.specs:
                if spec.format in failed_exports:
                    report[spec.name] = {"status": "failed", "exit": None, "last_line": failed_exports[spec.format],
                                         "attempts": 0, "duration_s": 0.0}
                    continue
                values = {"export_dir": exports.get(spec.format, ""), "checkpoint_dir": checkpoint_dir or "",
                          "step": str(step), "model_dir": self.model_dir}
                got, report[spec.name] = self._run_one(spec, os.path.join(work, spec.name, str(step)), values)
                metrics.update(got)
        finally:
            for directory in exports.values():
                shutil.rmtree(directory, ignore_errors=True)
        return metrics, report

    def _run_one(self, spec: ExternalEvaluatorConfig, run_dir: str,
                 values: dict[str, str]) -> tuple[dict[str, float], dict[str, Any]]:
        values = {**values, "output_dir": os.path.join(run_dir, "output")}
        start = time.perf_counter()
        failure: dict[str, Any] = {}
        for attempt in range(1, spec.retries + 2):
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh {output_dir} each attempt (and after a kill)
            os.makedirs(values["output_dir"])
            done = self._attempt(spec, values, run_dir)
            if done.timed_out:
                failure = {"status": "timeout", "exit": None,
                           "last_line": last_line(done.stderr, done.stdout) or f"no output in {spec.timeout_s:g} s"}
            elif done.exit != 0:
                failure = {"status": "failed", "exit": done.exit, "last_line": last_line(done.stderr, done.stdout)}
            else:
                try:
                    metrics = to_metrics(read_result(spec, values, done.stdout), spec.select, spec.metric_prefix)
                except ResultError as e:
                    failure = {"status": "failed", "exit": 0, "last_line": str(e)}
                else:
                    logger.info("evaluator %s, step %s: %d metrics in %.1f s", spec.name, values["step"], len(metrics),
                                done.duration_s)
                    return metrics, {"status": "ok", "exit": 0, "attempts": attempt, "metrics": len(metrics),
                                     "duration_s": round(time.perf_counter() - start, 3)}
            more = attempt <= spec.retries
            logger.warning("evaluator %s, step %s: %s (exit %s): %s%s", spec.name, values["step"], failure["status"],
                           failure["exit"], failure["last_line"], "; retrying" if more else "; giving up")
        return {}, {**failure, "attempts": spec.retries + 1, "duration_s": round(time.perf_counter() - start, 3)}

    def _attempt(self, spec: ExternalEvaluatorConfig, values: dict[str, str], run_dir: str) -> Attempt:
        argv = command_argv(spec, values)
        env = {**os.environ, **{k: render(v, values) for k, v in spec.env.items()}}
        die_with_us = parent_death_signal_setter(signal.SIGKILL)
        out_path, err_path = os.path.join(run_dir, "stdout.txt"), os.path.join(run_dir, "stderr.txt")
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=self.cwd,
                                        start_new_session=True, preexec_fn=die_with_us)
            except OSError as e:  # not found, not executable
                return Attempt(127, "", f"{argv[0]}: {e.strerror or e}", 0.0)
            try:
                code: int | None = proc.wait(spec.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
        return Attempt(code, _text(out_path), _text(err_path), time.perf_counter() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group (its session: what it started too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(_KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL (D state)
        logger.warning("evaluator command (pid %d) still runs after SIGKILL", proc.pid)


def _text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")
