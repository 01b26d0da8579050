"""The sidecar evaluator: a separate process that evaluates committed checkpoints as they appear.

Keras' ``SidecarEvaluator`` and tf.estimator's evaluator role, without their known failures: it
evaluates *every* checkpoint in step order (or only the latest, by choice), never reads a
half-written checkpoint (only committed, verified ones), never has one deleted from under it
(leases), never evaluates a step twice across restarts (``evaluations.jsonl``), never blocks on a
checkpoint that fails to load (retried, then recorded as failed), and never waits for ever on a
dead trainer (``timeout``).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.leases import LeaseKeeper, Leases
from cadence.checkpoint.watcher import CheckpointWatcher
from cadence.controller import Controller
from cadence.errors import CheckpointError
from cadence.storage import Storage
from cadence.summary import json_value, read_metrics

logger = logging.getLogger("cadence.sidecar")

EVALUATIONS_FILE = "evaluations.jsonl"
Status = Literal["evaluated", "failed", "skipped"]


def lease_holder(name: str | None = None) -> str:
    """The lease holder name of the sidecar called ``name`` (``sidecar-eval`` for the default)."""
    return f"sidecar-{name or 'eval'}"


class EvaluationLog:
    """``evaluations.jsonl``: one JSON record per checkpoint the sidecar dealt with.

    Each record: ``step``, ``checkpoint`` (its path), ``status`` (``evaluated`` | ``failed`` |
    ``skipped``), ``time``, and ``metrics`` + ``duration_s`` (evaluated) or ``error`` (the others).
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


@dataclass
class SidecarResult:
    """What a :meth:`SidecarEvaluator.start` did and why it stopped."""

    stop_reason: str  # "final" | "timeout" | "max_evaluations" | "stopped"
    message: str
    evaluated: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    best: dict[str, Any] | None = None  # {"metric", "step", "value"} over all evaluations.jsonl
    last_metrics: dict[str, Any] | None = None


class SidecarEvaluator:
    """Evaluates the committed checkpoints of ``model_dir`` while a trainer writes them.

    Args:
      task_or_evaluator: an evaluator (``evaluate(num_steps)`` + ``load_checkpoint``), or a
        ``cadence.torch.Task`` (a torch evaluator is built for it).
      model_dir: the trainer's model dir (local path or fsspec URL), shared with the trainer.
      mode: ``"every"`` evaluates each committed checkpoint in step order, including those that
        existed before it started; ``"latest"`` jumps to the newest (Keras / tf.estimator).
      steps: batches per evaluation; ``-1``: the whole eval data.
      max_evaluations: stop once this many checkpoints have been evaluated in total (restarts
        included, as recorded in ``evaluations.jsonl``). ``None``: no limit.
      timeout: stop after this many seconds without a new checkpoint (a dead trainer). ``None``:
        wait for ever for ``FINAL``.
      poll_interval: seconds between looks for new checkpoints (a new one is noticed within it).
      name: writes to ``eval_<name>/`` instead of ``eval/`` and holds the lease ``sidecar-<name>``;
        one sidecar per name and model dir.
      eval_actions: actions run on each evaluation's metrics (e.g. ``BestCheckpointExporter``).
      train_steps: a checkpoint at or past this step is final even before ``FINAL`` appears.
      max_pending: (``every`` mode) at most this many unevaluated checkpoints are kept from the
        trainer's retention (the one being read included); when more are waiting, the oldest are
        released and recorded as ``skipped``. ``None``: no bound.
      lease_ttl: seconds a lease lives without renewal; a killed sidecar's lease ends after it.
      max_retries: loading a committed checkpoint that fails is retried this many times, with
        exponential back-off from ``retry_backoff`` seconds, then recorded as ``failed``.
      best_metric / higher_is_better: the metric whose best is reported (and rebuilt from
        ``evaluations.jsonl`` on restart). ``None``: no best is tracked here.
      callbacks: :class:`~cadence.callbacks.Callback` objects told of each checkpoint restored
        (``on_checkpoint_load``), each evaluation (``on_eval_end``) and the end (``on_close``,
        always). A sidecar does not train: ``on_train_start`` / ``on_train_end`` /
        ``on_checkpoint_save`` never fire, and callbacks' state is not restored (it belongs to
        the training run).

    The stop conditions, each with a clear message: the final checkpoint was evaluated
    (``checkpoints/FINAL``, or a step >= ``train_steps``); ``max_evaluations``; ``timeout``
    seconds with no new checkpoint; SIGTERM/SIGINT (the current evaluation finishes first).
    """

    def __init__(
        self,
        task_or_evaluator: Any,
        model_dir: str,
        mode: Literal["every", "latest"] = "every",
        steps: int = -1,
        max_evaluations: int | None = None,
        timeout: float | None = None,
        poll_interval: float = 0.5,
        name: str | None = None,
        eval_actions: Iterable[Any] = (),
        *,
        train_steps: int | None = None,
        max_pending: int | None = 8,
        lease_ttl: float = 60.0,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        best_metric: str | None = None,
        higher_is_better: bool = True,
        storage_options: dict[str, Any] | None = None,
        callbacks: Iterable[Any] = (),
    ) -> None:
        if mode not in ("every", "latest"):
            raise ValueError(f"mode must be 'every' or 'latest', got {mode!r}")
        if max_evaluations is not None and max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1 or None, got {max_evaluations}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        self.evaluator = self._as_evaluator(task_or_evaluator)
        self.model_dir = model_dir
        self.mode = mode
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.name = name
        self.eval_actions = list(eval_actions)
        self.callbacks = list(callbacks)
        self.train_steps = train_steps
        self.max_pending = max_pending
        self.lease_ttl = lease_ttl
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.best_metric = best_metric
        self.higher_is_better = higher_is_better
        self.holder = lease_holder(name)
        self.eval_dir = layout.eval_dir(model_dir, name)
        self.manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False,
                                         storage_options=storage_options)
        self.leases = Leases(layout.checkpoints_dir(model_dir), storage_options=storage_options)
        self.log = EvaluationLog(self.eval_dir, storage_options)
        self._stop = threading.Event()

    @staticmethod
    def _as_evaluator(task_or_evaluator: Any) -> Any:
        if callable(getattr(task_or_evaluator, "evaluate", None)):
            return task_or_evaluator
        from cadence.torch import Context, build_runners  # a Task: build its torch evaluator

        _, evaluator = build_runners(task_or_evaluator, Context.create(), train=False, evaluate=True)
        return evaluator

    def stop(self) -> None:
        """Ask :meth:`start` to return after the current evaluation (thread- and signal-safe)."""
        self._stop.set()

    # ------------------------------------------------------------------ the loop

    def start(self) -> SidecarResult:
        """Evaluate checkpoints until a stop condition; return what was done and why it stopped."""
        records = self.log.records()
        done = {r["step"] for r in records}
        result = SidecarResult(stop_reason="", message="", best=self._best_of(records))
        evaluated_total = sum(r["status"] == "evaluated" for r in records)
        after = max(done) if done else None
        if done:
            logger.info("%s: resuming after step %d (%d checkpoints already in %s)", self.holder, after,
                        len(done), self.log.path)
        if self.max_evaluations is not None and evaluated_total >= self.max_evaluations:
            return self._finish(result, "max_evaluations", f"already evaluated {evaluated_total} checkpoints "
                                f"(max_evaluations={self.max_evaluations})")

        controller = Controller(evaluator=self.evaluator, checkpoint_manager=self.manager,
                                eval_summary_dir=self.eval_dir, eval_actions=self.eval_actions,
                                callbacks=self.callbacks, restore=False, progress=False)
        watcher = CheckpointWatcher(self.manager, mode=self.mode, poll_interval=self.poll_interval,
                                    timeout=self.timeout, after=after, train_steps=self.train_steps,
                                    should_stop=self._stop.is_set)
        # every: protect all checkpoints after the last one dealt with (-1: all of them)
        keeper = LeaseKeeper(self.leases, self.holder, ttl=self.lease_ttl,
                             after=(-1 if after is None else after) if self.mode == "every" else None,
                             max_pending=self.max_pending if self.mode == "every" else None).start()
        previous_handlers = self._install_signal_handlers()
        seen: set[int] = set()
        try:
            for step in watcher:
                if step in done:
                    continue
                waiting = [step, *watcher.pending()]
                seen.update(waiting)
                if self.mode == "every":
                    released = self._release_excess(waiting, watcher, keeper, seen, done, result)
                    if step in released:
                        continue
                keeper.update(reading=step)
                record = self._evaluate(controller, step)
                self.log.append(record)
                done.add(step)
                keeper.update(after=step if self.mode == "every" else None, reading=None)
                getattr(result, record["status"]).append(step)
                if record["status"] == "evaluated":
                    evaluated_total += 1
                    result.last_metrics = record["metrics"]
                    result.best = self._better(result.best, record)
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
        finally:
            keeper.close()
            controller.close()
            self._restore_signal_handlers(previous_handlers)

    def _release_excess(self, waiting: list[int], watcher: CheckpointWatcher, keeper: LeaseKeeper,
                        seen: set[int], done: set[int], result: SidecarResult) -> list[int]:
        """Record as skipped the checkpoints retention may delete or has deleted: the oldest of
        ``waiting`` beyond ``max_pending``, and seen ones already gone. Returns them."""
        gone = sorted(seen - done - set(self.manager.steps()))
        excess = []
        if self.max_pending is not None and len(waiting) > self.max_pending:
            excess = waiting[: len(waiting) - self.max_pending]
        reasons = {s: "deleted by the trainer's retention before it could be evaluated" for s in gone}
        reasons.update({s: f"more than max_pending={self.max_pending} checkpoints were waiting" for s in excess})
        for step in sorted(reasons):
            logger.warning("%s: skipping checkpoint %d: %s", self.holder, step, reasons[step])
            self.log.append(self._record(step, "skipped", error=reasons[step]))
            done.add(step)
            result.skipped.append(step)
        if excess:  # evaluate after them; the lease no longer holds them
            watcher.after = excess[-1]
            keeper.update(after=excess[-1])
        return sorted(reasons)

    def _evaluate(self, controller: Controller, step: int) -> dict[str, Any]:
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                controller.restore(step)
                break
            except CheckpointError as e:
                if step not in self.manager.steps():
                    return self._record(step, "skipped", error=f"deleted before it could be read ({e})")
                error = e
            if attempt < self.max_retries:
                delay = self.retry_backoff * 2**attempt
                logger.warning("%s: loading checkpoint %d failed (%s); retrying in %.1f s", self.holder, step,
                               error, delay)
                time.sleep(delay)
        else:
            logger.error("%s: checkpoint %d failed to load after %d attempts, skipping it: %s", self.holder,
                         step, self.max_retries + 1, error)
            return self._record(step, "failed", error=str(error))
        start = time.perf_counter()
        metrics = controller.evaluate(self.steps)
        record = self._record(step, "evaluated", metrics={k: json_value(v) for k, v in metrics.items()})
        record["duration_s"] = round(time.perf_counter() - start, 6)
        return record

    def _record(self, step: int, status: Status, **extra: Any) -> dict[str, Any]:
        return {"step": step, "checkpoint": self.manager.path(step), "status": status, "time": time.time(),
                "host": socket.gethostname(), **extra}

    # ------------------------------------------------------------------ best, stop, signals

    def _better(self, best: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any] | None:
        if self.best_metric is None or record.get("status") != "evaluated":
            return best
        value = record.get("metrics", {}).get(self.best_metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return best
        if best is None or (value > best["value"] if self.higher_is_better else value < best["value"]):
            return {"metric": self.best_metric, "step": record["step"], "value": value}
        return best

    def _best_of(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        best = None
        for record in records:
            best = self._better(best, record)
        return best

    def _finish(self, result: SidecarResult, reason: str, message: str) -> SidecarResult:
        result.stop_reason, result.message = reason, message
        best = f"; best {result.best['metric']}={result.best['value']:.6g} at step {result.best['step']}" \
            if result.best else ""
        logger.info("%s: %s (%d evaluated, %d failed, %d skipped in this run%s)", self.holder, message,
                    len(result.evaluated), len(result.failed), len(result.skipped), best)
        return result

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: self.stop())
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_sidecar(cfg: Any) -> dict[str, Any]:
    """Run the sidecar evaluator of an :class:`~cadence.config.ExperimentConfig` until it stops;
    return its :class:`SidecarResult` as a dict (``cadence evaluate --continuous``)."""
    from dataclasses import asdict

    from cadence.torch.experiment import build_sidecar

    return asdict(build_sidecar(cfg).start())
