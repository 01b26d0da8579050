"""The training loop: :class:`Controller` (Orbit's; the guide's "coming from another tool" page lists
the differences). The loop alone, its parts one job each: :mod:`cadence.checkpoint.session` (restore,
save, FINAL, rollback), :mod:`cadence.loop.hooks` (callbacks), :mod:`cadence.loop.schedule`
(intervals, segments, throttling), :mod:`cadence.loop.reports` (summaries, rates, progress),
:mod:`cadence.loop.members`, :mod:`cadence.sidecar.continuous`, :mod:`cadence.extensions` (what roles,
actions and callbacks may use and be). No framework is imported."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, TypeVar

from cadence.checkpoint.manager import CheckpointManager
from cadence.checkpoint.protocol import WritesShards
from cadence.checkpoint.session import CheckpointSession
from cadence.errors import StopTraining
from cadence.extensions import (Action, Callback, Closeable, EndsTraining, Evaluator, GathersCheckpoint,
                                JoinsPeers, RunAware, Trainer)
from cadence.loop.hooks import CallbackHooks
from cadence.loop.members import components
from cadence.loop.reports import LoopReports
from cadence.loop.run_state import RunState
from cadence.loop.sanity import sanity_check
from cadence.loop.schedule import (EvalThrottle, check_advance, check_interval, check_loop_settings, crossed,
                                   already_reached, loop_size, progress_total, segment_target)
from cadence.runtime.coordination import Coordinator, LocalCoordinator
from cadence.runtime.watchdog import Heartbeat
from cadence.sidecar.continuous import ContinuousEvaluation
from cadence.summaries.progress import ProgressReporter

logger = logging.getLogger("cadence")

StepsPerLoop = int | Callable[[int], int]
_T = TypeVar("_T")
__all__ = ["Controller", "Action"]


class Controller:
    """Runs training and evaluation in inner loops, with checkpoints, summaries and actions.

    Args:
      trainer: runs training steps and owns the global step (``train``, ``train_and_evaluate``).
      evaluator: evaluates the current model state (``evaluate``).
      checkpoint_manager: ``None``: no checkpoint is restored or saved.
      steps_per_loop: an int >= 1, or a callable ``global_step -> int`` called before each inner
        loop. Required with a trainer.
      checkpoint_interval: save after an inner loop in which the global step crossed a multiple
        of it. ``None``: only at completion.
      summary_interval: write train summaries after a loop that crossed a multiple of it (a
        multiple of an int ``steps_per_loop``). ``None``: after every loop.
      summary_dir, eval_summary_dir: where train / eval summaries go (TensorBoard events +
        ``metrics.jsonl``; a nested output's top-level keys get a subdirectory each, as in Orbit).
        ``None``: none; ``eval_summary_dir=None`` uses ``summary_dir``.
      train_actions: callables run on each inner loop's output (with its rates:
        :meth:`LoopReports.after_loop <cadence.loop.reports.LoopReports.after_loop>`).
      eval_actions: callables run on each evaluation's metrics.
      callbacks: :class:`~cadence.extensions.Callback` instances told about the run's events; those
        overriding ``on_train_step_end`` are called by the trainer after each step (it must be
        :class:`~cadence.extensions.ReportsSteps`).
      restore_step: the checkpoint restored on construction. ``None``: the latest committed one
        (a corrupt one is reported and skipped); an int: exactly that step (missing or corrupt
        raises :class:`~cadence.errors.CheckpointError`).
      restore: False restores nothing on construction, nor calls ``initialize()`` (a continuous
        evaluator restores each checkpoint itself). progress: a bar on a terminal, periodic lines
        otherwise; ``None``: on, but for non-zero ranks.
      coordinator: how the ranks of a job agree (``None``: one process). The chief alone writes
        checkpoints, ``FINAL`` and summaries; no rank goes on past a save before its commit; a stop
        on any rank is agreed at the end of the loop, so all ranks save and stop at one step.
      heartbeat: where the controller marks the phase it enters (``restore``, ``train``,
        ``actions``, ``checkpoint``, ``evaluate``) for a :class:`~cadence.runtime.watchdog.Watchdog`
        (``trainer.hang_timeout``); the runners beat it at each step. ``None``: nobody watches.

    Actions and callbacks take part through :mod:`cadence.extensions`' protocols: ``RunAware`` ones
    are attached once, before the restore (wrapped ones too); ``Stateful`` ones are in every
    checkpoint (:class:`~cadence.loop.run_state.RunState`); ``Closeable`` actions are closed by
    :meth:`close`. On construction the latest checkpoint is restored (model, optimizer, data
    position, RNG, actions' state); without one, an :class:`~cadence.extensions.Initializable`
    trainer's (or lone evaluator's) ``initialize()`` runs. With a trainer, what a killed run
    summarized past the restored step is dropped (:meth:`LoopReports.resume_at
    <cadence.loop.reports.LoopReports.resume_at>`).

    Raises:
      ValueError: neither trainer nor evaluator; bad ``steps_per_loop`` / intervals; with a
        trainer, a ``restore_step`` older than the latest checkpoint (two runs in one dir).
      TypeError: a callback that is not a :class:`~cadence.extensions.Callback`; a callback that
        overrides ``on_train_step_end`` with a trainer that is not ``ReportsSteps``.
    """

    def __init__(
        self,
        trainer: Trainer | None = None,
        evaluator: Evaluator | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        steps_per_loop: StepsPerLoop | None = None,
        checkpoint_interval: int | None = None,
        summary_interval: int | None = None,
        summary_dir: str | None = None,
        eval_summary_dir: str | None = None,
        train_actions: Iterable[Action] = (),
        eval_actions: Iterable[Action] = (),
        *,
        callbacks: Iterable[Callback] = (),
        restore_step: int | None = None,
        restore: bool = True,
        progress: bool | None = None,
        coordinator: Coordinator | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        if trainer is None and evaluator is None:
            raise ValueError("Controller needs a trainer, an evaluator, or both; got neither")
        check_loop_settings(steps_per_loop, checkpoint_interval, summary_interval, training=trainer is not None)
        self.trainer = trainer
        self.evaluator = evaluator
        self.checkpoint_manager = checkpoint_manager
        self.steps_per_loop = steps_per_loop
        self.checkpoint_interval = checkpoint_interval
        self.summary_interval = summary_interval
        self.train_actions = list(train_actions)
        self.eval_actions = list(eval_actions)
        self.coordinator: Coordinator = coordinator if coordinator is not None else LocalCoordinator()
        self.progress = progress if self.coordinator.is_chief else False
        self.restored_step: int | None = None
        self.stop_reason: str | None = None
        self._hooks = CallbackHooks(callbacks, self)
        self.callbacks = self._hooks.callbacks
        self._hooks.hand_step_end(trainer)
        self._session = CheckpointSession(checkpoint_manager, self.coordinator,
                                          on_save=self._hooks.checkpoint_save, on_load=self._hooks.checkpoint_load,
                                          shards=trainer if isinstance(trainer, WritesShards) else None)
        chief = self.coordinator.is_chief
        eval_dir = eval_summary_dir if eval_summary_dir is not None else summary_dir
        self._reports = LoopReports(summary_dir, eval_dir, chief=chief, summary_interval=summary_interval,
                                    hooks=self._hooks)
        self._components = components((*self.train_actions, *self.eval_actions, *self.callbacks))
        self._step = 0  # global step of an evaluator-only controller (from its checkpoint)
        self._state = RunState(self._session, trainer, evaluator, train_actions=self.train_actions,
                               eval_actions=self.eval_actions, callbacks=self.callbacks)
        self._save_pending = False
        self._heartbeat = heartbeat if heartbeat is not None else Heartbeat()
        try:
            for obj in self._components:
                if isinstance(obj, RunAware):
                    obj.attach(self)
            if trainer is not None:
                self._session.check_branch(restore_step)
            if restore:
                self._heartbeat.enter("restore")
                self.restored_step = self.restore(restore_step)
                if trainer is not None:  # what a killed run summarized past the restored step is redone
                    self._reports.resume_at(self.global_step, evaluates=evaluator is not None)
        except BaseException:
            self._close(propagating=True)  # e.g. signal handlers installed by attach()
            raise

    @property
    def global_step(self) -> int:
        """The trainer's global step; without a trainer, the restored checkpoint's."""
        return self.trainer.global_step if self.trainer is not None else self._step

    @property
    def last_eval_step(self) -> int | None:
        """The global step of the last evaluation (checkpointed); None before any."""
        return self._state.loop.last_eval_step

    def checkpoint_objects(self) -> dict[str, object]:
        """What a checkpoint holds (:class:`~cadence.loop.run_state.RunState`)."""
        return self._state.objects()

    def restore(self, step: int | None = None) -> int | None:
        """Restore checkpoint ``step`` (``None``: the latest); the restored step, then
        ``on_checkpoint_load``. With nothing to restore the runner's ``initialize()`` runs (if it
        is Initializable) and None is returned."""
        restored = self._state.restore(step)
        if restored is None:
            logger.info("no checkpoint restored: starting at step %d", self.global_step)
        else:
            self._step = restored
        return restored

    def rollback(self) -> int:
        """Restore the latest checkpoint's model, optimizer and global step, keeping the data
        position and RNG moving forward (NaN recovery; see
        :meth:`CheckpointSession.rollback <cadence.checkpoint.session.CheckpointSession.rollback>`);
        the step rolled back to. ValueError without a trainer or manager; CheckpointError
        without a committed checkpoint."""
        self._require(self.checkpoint_manager, "checkpoint_manager", "rollback")
        return self._session.rollback(self._require(self.trainer, "trainer", "rollback"))

    def save_checkpoint(self) -> str | None:
        """Collective: commit a checkpoint at the current step (the chief writes, every rank
        waits for the commit; a step saved twice is written once); its path, None without a
        manager. ``on_checkpoint_save`` runs for each commit reported so far."""
        self._heartbeat.enter("checkpoint", self.global_step)
        return self._session.save(self.global_step, self.checkpoint_objects, self.prepare_checkpoint)

    def prepare_checkpoint(self) -> None:
        """Collective, before a save: the trainer gathers what the chief saves from every rank."""
        if isinstance(self.trainer, GathersCheckpoint):
            self.trainer.prepare_checkpoint()

    def request_stop(self, reason: str) -> None:
        """End training cleanly after this inner loop (as an action raising StopTraining does)."""
        self.stop_reason = reason
        logger.info("stop requested at step %d: %s", self.global_step, reason)

    def train(self, steps: int | None = None, *, checkpoint_at_completion: bool = True) -> None:
        """Train until the global step reaches ``steps`` (absolute; a no-op when reached), in inner
        loops of ``steps_per_loop``. ``None``: until the data runs out (the trainer advancing fewer
        steps than asked). ``checkpoint_at_completion``: save and mark the run ``FINAL`` at the end
        (also after a stop). ``on_train_start`` runs first, ``on_train_end`` last.

        Raises ValueError without a trainer; RuntimeError when the trainer advanced another number
        of steps than asked (but for running out of data with ``steps=None``).
        """
        self._require(self.trainer, "trainer", "train")
        self.stop_reason = None
        with self._hooks.training(on_preempted=self._session.wait_for_commits):
            if already_reached(self.global_step, steps, saved=self.checkpoint_manager is not None):
                return
            self._session.reopen_if_final(steps)
            with self._progress(steps) as progress:
                self._train_until(steps, progress, until_exhausted=steps is None)
            if checkpoint_at_completion:
                self._complete()

    def _train_until(self, target: int | None, progress: ProgressReporter, *, until_exhausted: bool,
                     defer_save: bool = False) -> bool:
        """Run inner loops until ``target`` (None: no target) or a stop; True if the run is over.

        "Over" means the data ran out or an action asked to stop; reaching ``target`` is not.
        ``until_exhausted``: a trainer advancing fewer steps than requested means exhaustion
        rather than an error; so it does once an :class:`~cadence.extensions.EndsTraining` trainer's
        input has ended as configured (its epochs are done). ``defer_save``: an interval
        checkpoint due at the last loop is left to the caller (``_save_pending``), which saves it
        after the evaluation that follows, so the eval actions' state is in it.
        """
        trainer = self._require(self.trainer, "trainer", "train")
        while (target is None or self.global_step < target) and self.stop_reason is None:
            before = self.global_step
            requested = loop_size(self.steps_per_loop, before, target)
            start = time.perf_counter()
            self._heartbeat.enter("train", before)
            logs = dict(trainer.train(requested) or {})
            elapsed = time.perf_counter() - start
            self._session.after_loop()  # an asynchronous save that failed surfaces here
            after = self.global_step
            if isinstance(trainer, JoinsPeers) and trainer.loop_start_step != before:  # healed from a peer
                before = trainer.loop_start_step  # the loop counts from the peer's step, up to the step asked for
                requested = min(requested, after - before)
            self._heartbeat.enter("actions", after)
            ended = until_exhausted or (isinstance(trainer, EndsTraining) and trainer.training_ended)
            exhausted = check_advance(before, after, requested, until_exhausted=ended)
            if after == before:
                return True
            self._reports.after_loop(trainer, before, after, logs, elapsed, progress)
            with self._session.commit_on_error(lambda: self.global_step, self.checkpoint_objects,
                                               self.prepare_checkpoint, "a train action"):
                self._run_actions(self.train_actions, logs)
            self._agree_on_stop()
            if self.global_step != after:  # an action rolled the trainer back: nothing to save
                continue
            if self.checkpoint_manager is not None and crossed(before, after, self.checkpoint_interval):
                last = exhausted or self.stop_reason is not None or after == target
                if defer_save and last:
                    self._save_pending = True
                else:
                    self.save_checkpoint()
            if exhausted:
                logger.info("training data exhausted at step %d", after)
                return True
        return self.stop_reason is not None

    def evaluate(self, steps: int = -1) -> dict[str, Any]:
        """Evaluate ``steps`` batches (``-1``: all) of the current model state; return the metrics.
        Writes eval summaries at the global step, runs the eval actions (a stop sets
        :attr:`stop_reason`), then ``on_eval_end``. With ``steps`` > 0 the metrics (not the eval
        actions') also hold ``steps_per_second``, as Orbit's do. ValueError without an evaluator
        or for ``steps`` not -1 or >= 1."""
        return self._evaluate(steps, run_actions=True)

    def _evaluate(self, steps: int, *, run_actions: bool) -> dict[str, Any]:
        evaluator = self._require(self.evaluator, "evaluator", "evaluate")
        if not isinstance(steps, int) or isinstance(steps, bool) or (steps != -1 and steps < 1):
            raise ValueError(f"evaluate: steps must be -1 (all) or an int >= 1, got {steps!r}")
        start = time.perf_counter()
        self._heartbeat.enter("evaluate", self.global_step)
        metrics = dict(evaluator.evaluate(steps) or {})
        elapsed = time.perf_counter() - start
        step = self.global_step
        self._heartbeat.enter("actions", step)
        self._state.loop.last_eval_step = step
        rate = {"steps_per_second": steps / elapsed if elapsed > 0 else float("inf")} if steps > 0 else {}
        self._reports.after_evaluation(step, {**metrics, **rate}, elapsed)
        if run_actions:
            self._run_actions(self.eval_actions, metrics)
        metrics.update(rate)  # as Orbit's: in the summaries and the output, not seen by the eval actions
        self._hooks.eval_end(metrics, step)
        return metrics

    def evaluate_continuously(self, steps: int = -1, timeout: float | None = None,
                              timeout_fn: Callable[[], bool] | None = None, *, mode: str | None = None,
                              poll_interval: float | None = None) -> dict[str, Any] | None:
        """Evaluate checkpoints as they are committed; the last evaluation's metrics (None: none).
        Orbit's contract, run by :class:`~cadence.sidecar.continuous.ContinuousEvaluation` (its
        options; ``None``: its defaults). ValueError without an evaluator or a checkpoint manager."""
        self._require(self.evaluator, "evaluator", "evaluate_continuously")
        self._require(self.checkpoint_manager, "checkpoint_manager", "evaluate_continuously")
        result = ContinuousEvaluation(self, steps=steps, timeout=timeout, timeout_fn=timeout_fn, mode=mode,
                                      poll_interval=poll_interval).run()
        return result.last_metrics

    def train_and_evaluate(self, train_steps: int | None = None, eval_steps: int = -1,
                           eval_interval: int | None = None, *, throttle_secs: float = 0.0,
                           start_delay_secs: float = 0.0, sanity_steps: int = 0,
                           eval_at_start: bool = False) -> dict[str, Any]:
        """Alternate training and evaluation; return the last evaluation's metrics.

        Args:
          train_steps: absolute global-step target; ``None``: until the training data is exhausted.
          eval_steps: batches per evaluation (``-1``: all).
          eval_interval: evaluate whenever the global step reaches a multiple of it (absolute
            multiples: resumed runs evaluate at the same steps). ``None``: once, at the end.
          throttle_secs, start_delay_secs: tf.estimator's ``EvalSpec`` throttling
            (:class:`~cadence.loop.schedule.EvalThrottle`); the final evaluation is never skipped.
          sanity_steps: first evaluate this many batches, without summaries, and let the eval
            actions check the metrics (:func:`~cadence.loop.sanity.sanity_check`). 0: none.
          eval_at_start: evaluate the weights at step 0, before the first step: summaries and
            ``on_eval_end``, but no eval action sees it (a baseline). Not again on a resume.

        Each segment ends with an evaluation, *then* the checkpoint due at that step (holding the
        eval actions' state after it); a run resumed at an evaluation step whose evaluation never
        ran evaluates first; an evaluation's error after steps no checkpoint holds commits them
        first (:meth:`CheckpointSession.commit_on_error
        <cadence.checkpoint.session.CheckpointSession.commit_on_error>`). At the end (target, data
        exhausted, a stop) the final checkpoint and ``FINAL`` are written. A run already at
        ``train_steps`` does nothing and returns the metrics recorded then (``{}``: none).
        """
        self._require(self.trainer, "trainer", "train_and_evaluate")
        evaluator = self._require(self.evaluator, "evaluator", "train_and_evaluate")
        check_interval("eval_interval", eval_interval)
        throttle = EvalThrottle(throttle_secs, start_delay_secs)
        self.stop_reason = None
        reached = already_reached(self.global_step, train_steps, saved=self.checkpoint_manager is not None)
        if sanity_steps and not reached:  # before anything changes on disk
            sanity_check(evaluator, self.eval_actions, sanity_steps)
        self._session.reopen_if_final(train_steps)

        def evaluate(run_actions: bool = True) -> dict[str, Any]:
            throttle.evaluating()
            with self._session.commit_on_error(lambda: self.global_step, self._state.before_evaluation(),
                                               self.prepare_checkpoint, "the evaluation"):
                return self._evaluate(eval_steps, run_actions=run_actions)

        with self._hooks.training(on_preempted=self._session.wait_for_commits), \
                self._progress(train_steps, enabled=not reached) as progress:
            output: dict[str, Any] | None = None
            if self._state.loop.due_on_resume(self.global_step, eval_interval):
                output = evaluate()
            elif eval_at_start and not reached and self.global_step == 0 and self.last_eval_step != 0:
                output = evaluate(run_actions=False)
            over = reached or self.stop_reason is not None
            while not over:
                target = segment_target(self.global_step, train_steps, eval_interval)
                over = self._train_until(target, progress, until_exhausted=train_steps is None, defer_save=True)
                over = over or (train_steps is not None and self.global_step >= train_steps)
                fresh = self.last_eval_step != self.global_step  # not: the data ended right after an evaluation
                if fresh and (over or not throttle.skips()):
                    output = evaluate()
                elif fresh:
                    logger.info("evaluation at step %d skipped (start_delay_secs / throttle_secs)", self.global_step)
                self._agree_on_stop()
                over = over or self.stop_reason is not None
                if self._save_pending and not over:
                    self.save_checkpoint()
                self._save_pending = False
            if self.last_eval_step != self.global_step:
                output = evaluate()
            self._complete()
            return output if output is not None else self._reports.recorded(self.global_step)

    def _require(self, value: _T | None, role: str, method: str) -> _T:
        if value is None:
            raise ValueError(f"Controller.{method}() needs a {role}; this controller was built without one")
        return value

    def _run_actions(self, actions: list[Action], output: dict[str, Any]) -> None:
        for action in actions:
            try:
                action(output)
            except StopTraining as stop:
                self.request_stop(stop.reason)

    def _agree_on_stop(self) -> None:
        """Collective (several ranks): a stop asked for on any rank stops every rank."""
        agreed = self.coordinator.world_size > 1 and self.coordinator.any(self.stop_reason is not None)
        if agreed and self.stop_reason is None:
            self.stop_reason = "stop requested on another rank"

    def _complete(self) -> None:
        """Save the final checkpoint and mark the run FINAL (with the stop's reason, when stopped)."""
        self._session.complete(self.global_step, self.save_checkpoint, reason=self.stop_reason)

    def _progress(self, total: int | None, *, enabled: bool = True) -> ProgressReporter:
        total, on = progress_total(self.trainer, total), enabled and self.progress
        return ProgressReporter(total, initial_step=self.global_step, enabled=on)

    def close(self) -> None:
        """Wait for a pending asynchronous checkpoint (raising its failure) and report its commit,
        then -- always -- close the summary writers, the ``Closeable`` actions and the callbacks
        (``on_close``, once: :meth:`CallbackHooks.close_run <cadence.loop.hooks.CallbackHooks.close_run>`)."""
        self._close(propagating=False)

    def _close(self, propagating: bool) -> None:
        closeables = [o for o in self._components if isinstance(o, Closeable) and not isinstance(o, Callback)]
        self._hooks.close_run(self._session.close, self._reports.train.close, self._reports.eval.close,
                              *(o.close for o in closeables), propagating=propagating)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._close(propagating=exc_type is not None)
