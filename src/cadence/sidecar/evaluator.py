"""The sidecar evaluator: :class:`SidecarEvaluator` (Keras' ``SidecarEvaluator``, tf.estimator's
evaluator role).

It runs :class:`~cadence.sidecar.continuous.ContinuousEvaluation` (the loop under
``Controller.evaluate_continuously`` too) in a separate process and adds what a separate process
needs: leases, so the trainer's retention never deletes a checkpoint from under it;
``evaluations.jsonl``, so a restarted sidecar never evaluates a step twice; and SIGTERM handling.

Framework-agnostic: the evaluator is any :class:`~cadence.extensions.Evaluator` that restores
checkpoints (``cadence.torch.experiments.experiment.build_sidecar`` builds one for a Task).
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Iterable, Literal

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.checkpoint.leases import Leases
from cadence.extensions import Evaluator
from cadence.loop.controller import Controller
from cadence.runtime.coordination import Coordinator
from cadence.runtime.signals import install_handlers
from cadence.sidecar.continuous import (DEFAULTS, EVALUATIONS_FILE, BestTracker, ContinuousEvaluation, EvaluationLog,
                                        SidecarResult)
from cadence.sidecar.ranks import ChiefRun, follow

__all__ = ["EVALUATIONS_FILE", "EvaluationLog", "SidecarEvaluator", "SidecarResult", "lease_holder"]


def lease_holder(name: str | None = None) -> str:
    """The lease holder name of the sidecar called ``name`` (``sidecar-eval`` for the default)."""
    return f"sidecar-{name or 'eval'}"


class SidecarEvaluator:
    """Evaluates the committed checkpoints of ``model_dir`` while a trainer writes them.

    Args:
      evaluator: an :class:`~cadence.extensions.Evaluator` that restores checkpoints
        (``load_checkpoint``); for a ``cadence.torch.Task``, use
        ``cadence.torch.experiments.experiment.build_sidecar``.
      model_dir: the trainer's model dir (local path or fsspec URL), shared with the trainer.
      steps: batches per evaluation; ``-1``: the whole eval data.
      mode, max_evaluations, timeout, poll_interval, name, max_pending, lease_ttl, max_retries,
        retry_backoff: the ``sidecar:`` settings, with their defaults and meaning from
        :class:`~cadence.config.SidecarConfig` (``mode="every"`` evaluates each committed
        checkpoint in step order, ``"latest"`` jumps to the newest; ``max_evaluations`` counts
        restarts too, as recorded in ``evaluations.jsonl``; ``name`` writes to ``eval_<name>/``
        and holds the lease ``sidecar-<name>``, one sidecar per name and model dir).
      eval_actions: actions run on each evaluation's metrics (e.g. ``BestCheckpointExporter``).
      train_steps: a checkpoint at or past this step is final even before ``FINAL`` appears.
      best_metric / higher_is_better: the metric whose best is reported (and rebuilt from
        ``evaluations.jsonl`` on restart). ``None``: no best is tracked here.
      callbacks: :class:`~cadence.extensions.Callback` objects told of each checkpoint restored
        (``on_checkpoint_load``), each evaluation (``on_eval_end``) and the end (``on_close``,
        always). A sidecar does not train: ``on_train_start`` / ``on_train_end`` /
        ``on_checkpoint_save`` never fire, and callbacks' state is not restored (it belongs to
        the training run).
      coordinator: the ranks of a sidecar of several processes (``None``: one). The chief alone
        watches, holds the lease and writes ``evaluations.jsonl``; every rank restores and
        evaluates each checkpoint it picks (:mod:`cadence.sidecar.ranks`).

    The stop conditions, each with a clear message: the final checkpoint was evaluated
    (``checkpoints/FINAL``, or a step >= ``train_steps``); ``max_evaluations``; ``timeout``
    seconds with no new checkpoint; SIGTERM/SIGINT (the current evaluation finishes first).
    """

    def __init__(
        self,
        evaluator: Evaluator,
        model_dir: str,
        mode: Literal["every", "latest"] = DEFAULTS.mode,
        steps: int = -1,
        max_evaluations: int | None = DEFAULTS.max_evaluations,
        timeout: float | None = DEFAULTS.timeout,
        poll_interval: float = DEFAULTS.poll_interval,
        name: str | None = DEFAULTS.name,
        eval_actions: Iterable[Any] = (),
        *,
        train_steps: int | None = None,
        max_pending: int | None = DEFAULTS.max_pending,
        lease_ttl: float = DEFAULTS.lease_ttl,
        max_retries: int = DEFAULTS.max_retries,
        retry_backoff: float = DEFAULTS.retry_backoff,
        best_metric: str | None = None,
        higher_is_better: bool = True,
        storage_options: dict[str, Any] | None = None,
        callbacks: Iterable[Any] = (),
        coordinator: Coordinator | None = None,
    ) -> None:
        if mode not in ("every", "latest"):
            raise ValueError(f"mode must be 'every' or 'latest', got {mode!r}")
        if max_evaluations is not None and max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1 or None, got {max_evaluations}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        if not isinstance(evaluator, Evaluator):
            raise TypeError(f"SidecarEvaluator needs an evaluator (evaluate(num_steps)), got {type(evaluator).__name__}; "
                            "for a Task use cadence.torch.experiments.experiment.build_sidecar")
        self.evaluator = evaluator
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
        self.best = BestTracker(best_metric, higher_is_better)
        self.holder = lease_holder(name)
        self.eval_dir = layout.eval_dir(model_dir, name)
        self.manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False,
                                         storage_options=storage_options)
        self.leases = Leases(layout.checkpoints_dir(model_dir), storage_options=storage_options)
        self.log = EvaluationLog(self.eval_dir, storage_options)
        self.coordinator = coordinator
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask :meth:`start` to return after the current evaluation (thread- and signal-safe)."""
        self._stop.set()

    def start(self) -> SidecarResult:
        """Evaluate checkpoints until a stop condition; return what was done and why it stopped.
        With a coordinator of several ranks, on every rank: the chief leads, the others follow
        (:mod:`cadence.sidecar.ranks`), and every rank returns the chief's result."""
        controller = Controller(evaluator=self.evaluator, checkpoint_manager=self.manager,
                                eval_summary_dir=self.eval_dir, eval_actions=self.eval_actions,
                                callbacks=self.callbacks, restore=False, progress=False, coordinator=self.coordinator)
        if self.coordinator is None or self.coordinator.world_size == 1:
            return self._lead(controller, None)
        if not self.coordinator.is_chief:
            return self._follow(controller)
        run = ChiefRun(controller, self.coordinator)
        try:
            result = self._lead(controller, run)
        except BaseException as e:
            run.fail(e)  # the others raise too, rather than wait for a command that never comes
            raise
        run.end(result)
        return result

    def _lead(self, controller: Controller, run: ChiefRun | None) -> SidecarResult:
        """The sidecar's loop, its lease and its log (one process, or the chief of several ranks,
        whose restores and evaluations ``run`` broadcasts); closes ``controller``."""
        done = [r["step"] for r in self.log.records()]
        after = max(done) if done else None
        every = self.mode == "every"
        # every: protect all checkpoints after the last one dealt with (-1: all of them)
        keeper = LeaseKeeper(self.leases, self.holder, ttl=self.lease_ttl,
                             after=(-1 if after is None else after) if every else None,
                             max_pending=self.max_pending if every else None).start()
        handlers = install_handlers((signal.SIGTERM, signal.SIGINT), lambda *_: self.stop(), owner=self.holder)
        try:
            return ContinuousEvaluation(
                run or controller, steps=self.steps, mode=self.mode, poll_interval=self.poll_interval,
                timeout=self.timeout, max_evaluations=self.max_evaluations, train_steps=self.train_steps,
                max_retries=self.max_retries, retry_backoff=self.retry_backoff, log=self.log, keeper=keeper,
                max_pending=self.max_pending, best=self.best, name=self.holder,
                should_stop=run.should_stop(self._stop.is_set) if run else self._stop.is_set,
            ).run()
        finally:
            keeper.close()
            controller.close()
            handlers.restore()

    def _follow(self, controller: Controller) -> SidecarResult:
        """A rank other than the chief: restore and evaluate what the chief picks; no lease, no log."""
        assert self.coordinator is not None
        handlers = install_handlers((signal.SIGTERM, signal.SIGINT), lambda *_: self.stop(), owner=self.holder)
        try:
            return follow(controller, self.coordinator, self._stop.is_set)
        finally:
            controller.close()
            handlers.restore()
