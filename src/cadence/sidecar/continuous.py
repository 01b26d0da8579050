"""The one continuous-evaluation loop: :class:`ContinuousEvaluation`, under both
``Controller.evaluate_continuously`` and the sidecar (:class:`~cadence.sidecar.evaluator.SidecarEvaluator`).

It follows a run's checkpoints as they are committed, restores each into the run and evaluates it,
retries a checkpoint that fails to load and then records it as failed, and stops on ``FINAL``, a
timeout, ``max_evaluations`` or a request. What it is given is an :class:`EvaluationRun` (a
:class:`~cadence.Controller` with an evaluator and a checkpoint manager); what it did goes into an
:class:`EvaluationLog` (``evaluations.jsonl``) and a :class:`SidecarResult`.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from cadence import layout
from cadence.actions.metric_path import get_metric, is_better
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.checkpoint.watcher import CheckpointWatcher, Mode
from cadence.config.schema import SidecarConfig
from cadence.errors import CheckpointError
from cadence.sidecar.external import ReportsExternal
from cadence.storage import Storage
from cadence.summaries.metrics_file import read_metrics
from cadence.summaries.scalars import json_value

logger = logging.getLogger("cadence.sidecar.evaluator")

__all__ = ["BestTracker", "ContinuousEvaluation", "EVALUATIONS_FILE", "EvaluationLog", "EvaluationRun",
           "SidecarResult", "resume_after"]

EVALUATIONS_FILE = "evaluations.jsonl"
Status = Literal["evaluated", "failed", "skipped"]
DEFAULTS = SidecarConfig()  # the sidecar's settings and their defaults live in its config section


class EvaluationRun(Protocol):
    """What continuous evaluation needs of a run (a :class:`~cadence.Controller` is one)."""

    @property
    def checkpoint_manager(self) -> CheckpointManager | None: ...

    def restore(self, step: int | None = None) -> int | None:
        """Restore checkpoint ``step`` into the run; ``CheckpointError`` when it cannot be read."""
        ...

    def evaluate(self, steps: int = -1) -> dict[str, Any]:
        """Evaluate the restored state (summaries, eval actions, callbacks); the metrics."""
        ...


class EvaluationLog:
    """``evaluations.jsonl``: one JSON record per checkpoint the sidecar dealt with.

    Each record: ``step``, ``checkpoint`` (its path), ``status`` (``evaluated`` | ``failed`` |
    ``skipped``), ``time``, and ``metrics`` + ``duration_s`` (evaluated) or ``error`` (the others);
    with external evaluators, ``external``: what each command did (its ``status``, ``exit``, ``last_line``).
    Appends rewrite the file atomically, so a killed sidecar leaves whole records only.
    """

    def __init__(self, eval_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage = Storage(layout.join(eval_dir, EVALUATIONS_FILE), storage_options)
        self.path = self.storage.url(self.storage.root)

    def records(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.path) if isinstance(r.get("step"), int) and "status" in r]

    def append(self, record: dict[str, Any]) -> None:
        try:
            existing = self.storage.read_bytes(self.storage.root)
        except FileNotFoundError:
            existing = b""
            self.storage.makedirs(self.storage.root.rsplit("/", 1)[0])
        if existing and not existing.endswith(b"\n"):
            existing += b"\n"
        self.storage.write_atomic(self.storage.root, existing + (json.dumps(record) + "\n").encode())


def resume_after(done: set[int], committed: list[int], mode: str) -> int | None:
    """The step after which a sidecar with records of the steps ``done`` resumes: the newest of
    them (None: none). In ``every`` mode, when an older committed step has no record (a backfill of
    chosen steps leaves such gaps), the newest recorded step before it instead: every committed
    checkpoint gets its record, the recorded ones are passed over."""
    after = max(done) if done else None
    missing = [s for s in committed if s not in done]
    if mode == "every" and after is not None and missing and missing[0] < after:
        after = max((s for s in done if s < missing[0]), default=None)
    return after


@dataclass
class SidecarResult:
    """What a continuous evaluation did and why it stopped."""

    stop_reason: str  # "final" | "timeout" | "max_evaluations" | "stopped"; a backfill's: "backfilled" | "stopped"
    message: str
    evaluated: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    best: dict[str, Any] | None = None  # {"metric", "step", "value"} (the sidecar: over all evaluations.jsonl)
    last_metrics: dict[str, Any] | None = None

    def of_status(self, status: Status) -> list[int]:
        """The steps recorded with ``status``."""
        return {"evaluated": self.evaluated, "failed": self.failed, "skipped": self.skipped}[status]


@dataclass
class BestTracker:
    """The best value of one metric over evaluation records."""

    metric: str | None
    higher_is_better: bool = True

    def update(self, best: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any] | None:
        """``best`` or, when ``record`` is an evaluation with a better finite value, ``record``'s.
        The metric is read as the actions read it (:func:`~cadence.actions.metric_path.get_metric`:
        ``val/loss`` is a named split's)."""
        if self.metric is None or record.get("status") != "evaluated":
            return best
        try:
            value = get_metric(record.get("metrics") or {}, self.metric)
        except (KeyError, TypeError):  # not there, or not a number
            return best
        if not math.isfinite(value):
            return best
        if is_better(value, None if best is None else best["value"], higher_is_better=self.higher_is_better):
            return {"metric": self.metric, "step": record["step"], "value": value}
        return best


class ContinuousEvaluation:
    """Evaluates ``controller``'s committed checkpoints as they appear; :meth:`run` returns a
    :class:`SidecarResult`.

    Args:
      controller: a controller with an evaluator and a checkpoint manager; each checkpoint is
        restored into it (``Controller.restore``) and evaluated (``Controller.evaluate``: eval
        summaries, eval actions and callbacks).
      steps: batches per evaluation; ``-1``: the whole eval data.
      mode, poll_interval, max_retries, retry_backoff: see
        :class:`~cadence.config.SidecarConfig` (``None``: its default).
      timeout: stop after this many seconds without a new checkpoint; ``None``: wait for ever.
      timeout_fn: on timeout, True (or no ``timeout_fn``) stops, False waits on (Orbit's).
      max_evaluations: stop once this many checkpoints were evaluated in total (``None``: no limit).
      train_steps: a checkpoint at or past this step is final even before ``FINAL`` appears.
      log: where records go and, on start, which steps were already dealt with (``None``: none).
      keeper: a started lease keeper protecting the checkpoints still to evaluate (``None``: no lease).
      max_pending: (``every`` mode, with a keeper) the unevaluated checkpoints held back from
        retention; the oldest beyond it are recorded as skipped.
      best: which metric's best to report.
      should_stop: polled between checkpoints; True ends the run (``"stopped"``).
      name: who is evaluating, for log lines.
      external: the evaluator, when it runs external commands: what they did goes into each
        evaluated step's record (``external``), written after them.

    Stop reasons: ``"final"`` (the final checkpoint was evaluated), ``"timeout"``,
    ``"max_evaluations"``, ``"stopped"``.
    """

    def __init__(
        self,
        controller: EvaluationRun,
        *,
        steps: int = -1,
        mode: str | None = None,
        poll_interval: float | None = None,
        timeout: float | None = None,
        timeout_fn: Callable[[], bool] | None = None,
        max_evaluations: int | None = None,
        train_steps: int | None = None,
        max_retries: int | None = None,
        retry_backoff: float | None = None,
        log: EvaluationLog | None = None,
        keeper: LeaseKeeper | None = None,
        max_pending: int | None = None,
        best: BestTracker | None = None,
        should_stop: Callable[[], bool] | None = None,
        name: str = "evaluate_continuously",
        external: ReportsExternal | None = None,
    ) -> None:
        mode = DEFAULTS.mode if mode is None else mode
        if mode != "every" and mode != "latest":
            raise ValueError(f"mode must be 'every' or 'latest', got {mode!r}")
        if controller.checkpoint_manager is None:
            raise ValueError("continuous evaluation needs a controller with a checkpoint manager")
        self.controller = controller
        self.manager: CheckpointManager = controller.checkpoint_manager
        self.steps = steps
        self.mode: Mode = "every" if mode == "every" else "latest"
        self.poll_interval = DEFAULTS.poll_interval if poll_interval is None else poll_interval
        self.timeout = timeout
        self.timeout_fn = timeout_fn
        self.max_evaluations = max_evaluations
        self.train_steps = train_steps
        self.max_retries = DEFAULTS.max_retries if max_retries is None else max_retries
        self.retry_backoff = DEFAULTS.retry_backoff if retry_backoff is None else retry_backoff
        self.log = log
        self.keeper = keeper
        self.max_pending = max_pending
        self.best = best or BestTracker(None)
        self.should_stop = should_stop
        self.name = name
        self.external = external

    def run(self) -> SidecarResult:
        """Evaluate checkpoints until a stop condition; return what was done and why it stopped."""
        records = self.log.records() if self.log is not None else []
        done = {r["step"] for r in records}
        result = SidecarResult(stop_reason="", message="", best=self._best_of(records))
        evaluated_total = sum(r["status"] == "evaluated" for r in records)
        after = resume_after(done, self.manager.steps(), self.mode)
        if done and self.log is not None:
            logger.info("%s: resuming after step %s (%d checkpoints already in %s)", self.name, after,
                        len(done), self.log.path)
        if self.max_evaluations is not None and evaluated_total >= self.max_evaluations:
            return self._finish(result, "max_evaluations", f"already evaluated {evaluated_total} checkpoints "
                                f"(max_evaluations={self.max_evaluations})")
        watcher = CheckpointWatcher(self.manager, mode=self.mode, poll_interval=self.poll_interval,
                                    timeout=self.timeout, timeout_fn=self.timeout_fn, after=after,
                                    train_steps=self.train_steps, should_stop=self.should_stop)
        seen: set[int] = set()
        for step in watcher:
            if step in done:
                continue
            waiting = [step, *(s for s in watcher.pending() if s not in done)]
            seen.update(waiting)
            releasing = self.mode == "every" and self.keeper is not None
            if releasing and step in self._release_excess(waiting, watcher, seen, done, result):
                continue
            self._keep(reading=step)
            record = self._evaluate(step)
            self._record(record)
            done.add(step)
            self._keep(after=step if self.mode == "every" else None, reading=None)
            self._tally(result, record)
            evaluated_total += record["status"] == "evaluated"
            if self.max_evaluations is not None and evaluated_total >= self.max_evaluations:
                return self._finish(result, "max_evaluations",
                                    f"evaluated {evaluated_total} checkpoints (max_evaluations={self.max_evaluations})")
        reason = watcher.stop_reason or "stopped"
        if reason == "final":
            message = f"evaluated the final checkpoint (step {watcher.after})"
        elif reason == "timeout":
            message = (f"no new checkpoint in {self.manager.directory} for {self.timeout:g} s and no FINAL: "
                       "stopping (is the trainer still running?)")
        else:
            message = "stopped on request"
        return self._finish(result, reason, message)

    def _keep(self, **protect: int | None) -> None:
        if self.keeper is not None:
            self.keeper.update(**protect)

    def _record(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.append(record)

    def _tally(self, result: SidecarResult, record: dict[str, Any]) -> None:
        """Count ``record`` (just written) in ``result``: its status list, and for an evaluation the
        last metrics and the best."""
        result.of_status(record["status"]).append(record["step"])
        if record["status"] == "evaluated":
            result.last_metrics = record["metrics"]
            result.best = self.best.update(result.best, record)

    def _release_excess(self, waiting: list[int], watcher: CheckpointWatcher, seen: set[int], done: set[int],
                        result: SidecarResult) -> list[int]:
        """Record as skipped the checkpoints retention may delete or has deleted: the oldest of
        ``waiting`` beyond ``max_pending``, seen ones already gone, and those the writer deleted
        before they were ever seen (its ``deleted-steps`` note: they left the lease's bounded range,
        or were deleted before this reader started). Returns them."""
        present = set(self.manager.steps())
        gone = sorted(seen - done - present)
        assert self.keeper is not None
        unseen = sorted(set(self.keeper.leases.deleted()) - done - present - set(gone))
        excess = []
        if self.max_pending is not None and len(waiting) > self.max_pending:
            excess = waiting[: len(waiting) - self.max_pending]
        reasons = dict.fromkeys(gone, "deleted by the trainer's retention before it could be evaluated"
                                      + self._bound_note())
        reasons.update(dict.fromkeys(unseen, "deleted by the trainer's retention before it was seen (more than "
                                             f"max_pending={self.max_pending} checkpoints were waiting, or it "
                                             "was deleted before this evaluator started)"))
        reasons.update(dict.fromkeys(excess, f"more than max_pending={self.max_pending} checkpoints were waiting"))
        for step in sorted(reasons):
            logger.warning("%s: skipping checkpoint %d: %s", self.name, step, reasons[step])
            self._record(self._new_record(step, "skipped", error=reasons[step]))
            done.add(step)
            result.skipped.append(step)
        if excess:  # evaluate after them; the lease no longer holds them
            watcher.after = excess[-1]
            self._keep(after=excess[-1])
        return sorted(reasons)

    def _bound_note(self) -> str:
        """Why retention could delete a checkpoint this evaluator had seen: the lease's bound."""
        if self.keeper is None or self.max_pending is None:
            return ""
        return f" (more than max_pending={self.max_pending} newer checkpoints were committed while it waited)"

    def _evaluate(self, step: int) -> dict[str, Any]:
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                self.controller.restore(step)
                break
            except CheckpointError as e:
                if step not in self.manager.steps():
                    return self._new_record(step, "skipped",
                                            error=f"deleted before it could be read{self._bound_note()} ({e})")
                error = e
            if attempt < self.max_retries:
                delay = self.retry_backoff * 2**attempt
                logger.warning("%s: loading checkpoint %d failed (%s); retrying in %.1f s", self.name, step,
                               error, delay)
                time.sleep(delay)
        else:
            logger.error("%s: checkpoint %d failed to load after %d attempts, skipping it: %s", self.name,
                         step, self.max_retries + 1, error)
            return self._new_record(step, "failed", error=str(error))
        start = time.perf_counter()
        try:
            metrics = self.controller.evaluate(self.steps)
        except CheckpointError as e:
            # Retention may delete a checkpoint after it was loaded (a step that left a bounded lease
            # range before ``reading`` protected it): an action that reads it again (best/'s copy)
            # fails. Its evaluation is recorded as skipped, never half-acted on.
            if step in self.manager.steps():
                raise
            logger.warning("%s: checkpoint %d was deleted while it was evaluated: skipping it (%s)", self.name,
                           step, e)
            return self._new_record(step, "skipped", error="deleted by the trainer's retention while it was "
                                    f"evaluated{self._bound_note()} ({e})")
        record = self._new_record(step, "evaluated", metrics={k: json_value(v) for k, v in metrics.items()})
        record["duration_s"] = round(time.perf_counter() - start, 6)
        report = self.external.external_report() if self.external is not None else None
        if report:
            record["external"] = report
        return record

    def _new_record(self, step: int, status: Status, **extra: Any) -> dict[str, Any]:
        return {"step": step, "checkpoint": self.manager.path(step), "status": status, "time": time.time(),
                "host": socket.gethostname(), **extra}

    def _best_of(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        best = None
        for record in records:
            best = self.best.update(best, record)
        return best

    def _finish(self, result: SidecarResult, reason: str, message: str) -> SidecarResult:
        result.stop_reason, result.message = reason, message
        best = f"; best {result.best['metric']}={result.best['value']:.6g} at step {result.best['step']}" \
            if result.best else ""
        logger.info("%s: %s (%d evaluated, %d failed, %d skipped in this run%s)", self.name, message,
                    len(result.evaluated), len(result.failed), len(result.skipped), best)
        return result
