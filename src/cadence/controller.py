"""The training loop: :class:`Controller` (Orbit's design, with cadence's fixes).

One explicit loop drives a :class:`~cadence.runner.Trainer` and/or an
:class:`~cadence.runner.Evaluator` in *inner loops* of ``steps_per_loop`` steps. After each inner
loop it writes summaries (when due), runs the train actions on the loop's output, and saves a
checkpoint (when due). Nothing here imports a framework.

What differs from Orbit, on purpose:

* ``train(steps=None)`` trains until the training data is exhausted.
* A checkpoint is **always** saved at completion when a checkpoint manager is present (Orbit never
  saves without an interval), and ``checkpoints/FINAL`` is written when training is complete.
* An action may end training cleanly by raising :class:`~cadence.errors.StopTraining`.
* ``train_and_evaluate`` cuts its segments at absolute multiples of ``eval_interval``, so a resumed
  run evaluates at the same steps as an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping, TypeVar

from cadence.callbacks import Callback
from cadence.coordination import Coordinator, LocalCoordinator
from cadence.errors import CheckpointError, PreemptedExit, StopTraining
from cadence.progress import ProgressReporter
from cadence.runner import Evaluator, Trainer
from cadence.summary import SummaryWriter

logger = logging.getLogger("cadence")

Action = Callable[[dict[str, Any]], Any]
StepsPerLoop = int | Callable[[int], int]
_T = TypeVar("_T")

__all__ = ["Controller", "Action"]


def _crossed(before: int, after: int, interval: int | None) -> bool:
    """True when a multiple of ``interval`` lies in ``(before, after]``."""
    return interval is not None and after // interval > before // interval


def _check_interval(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _LoopState:
    """The controller's own checkpointed state: the step of the last evaluation."""

    def __init__(self) -> None:
        self.last_eval_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"last_eval_step": self.last_eval_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_eval_step = state.get("last_eval_step")


class _KeepDataPosition:
    """Restores a trainer's model and optimizer state but not its data position or RNG."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def load_checkpoint(self, reader: Any, state: Any) -> None:
        self.trainer.load_checkpoint(reader, state, restore_data=False, restore_rng=False)


class Controller:
    """Runs training and evaluation in inner loops, with checkpoints, summaries and actions.

    Args:
      trainer: runs training steps and owns the global step. Required by ``train`` and
        ``train_and_evaluate``.
      evaluator: evaluates the current model state. Required by ``evaluate``.
      checkpoint_manager: a :class:`~cadence.checkpoint.CheckpointManager`. ``None``: no
        checkpoint is restored or saved.
      steps_per_loop: steps per inner loop: an int >= 1, or a callable ``global_step -> int``
        evaluated before each inner loop. Required with a trainer.
      checkpoint_interval: save a checkpoint after an inner loop in which the global step crossed a
        multiple of it. ``None``: save only at completion.
      summary_interval: write train summaries after an inner loop in which the global step crossed
        a multiple of it; must be a multiple of ``steps_per_loop`` when both are ints. ``None``:
        after every inner loop.
      summary_dir: where train summaries go (TensorBoard events + ``metrics.jsonl``). ``None``:
        no train summaries.
      eval_summary_dir: where eval summaries go. ``None``: ``summary_dir``'s value.
      train_actions: callables run on each inner loop's output dict, which includes
        ``steps_per_second``. Actions with ``state_dict``/``load_state_dict`` are checkpointed;
        an action with ``attach(controller)`` is handed this controller once, before the restore.
      eval_actions: callables run on each evaluation's metrics dict (same rules).
      callbacks: :class:`~cadence.callbacks.Callback` objects told about the run's events
        (training start and end, checkpoint committed or restored, evaluation done, close); a
        hook is called only if the object has it. Same rules as actions for ``attach`` and
        ``state_dict``/``load_state_dict`` (saved under ``callbacks/<i>/<ClassName>``).
      restore_step: the checkpoint restored on construction. ``None``: the latest committed one
        (a corrupt one is reported and skipped, falling back to the previous); an int: exactly that
        step (missing or corrupt raises :class:`~cadence.errors.CheckpointError`).
      restore: False restores nothing on construction (nor calls ``initialize()``): a continuous
        evaluator restores each checkpoint itself. :attr:`restored_step` is then None.
      progress: show progress (a bar on a terminal, periodic lines otherwise). ``None``: on,
        except in processes of a non-zero ``RANK``.
      coordinator: how the ranks of a multi-process job agree (``cadence.torch`` passes one on
        ``torch.distributed``). ``None``: a single process. With several ranks, the chief (rank 0)
        alone writes checkpoints, ``FINAL`` and summaries; no rank goes on past a save until it
        is committed; a stop asked for on any rank (an action's :class:`StopTraining`) is agreed
        at the end of the inner loop, so all ranks save and stop at the same step.

    On construction the controller restores a checkpoint if the manager has one (model, optimizer,
    data position, RNG, actions' state: whatever the trainer and actions save). When none exists,
    ``trainer.initialize()`` (or ``evaluator.initialize()`` without a trainer) is called if defined.

    Raises:
      ValueError: neither trainer nor evaluator; bad ``steps_per_loop`` / intervals.
    """

    def __init__(
        self,
        trainer: Trainer | None = None,
        evaluator: Evaluator | None = None,
        checkpoint_manager: Any | None = None,
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
    ) -> None:
        if trainer is None and evaluator is None:
            raise ValueError("Controller needs a trainer, an evaluator, or both; got neither")
        if trainer is not None:
            if steps_per_loop is None:
                raise ValueError("steps_per_loop is required when a trainer is given")
            if not callable(steps_per_loop):
                _check_interval("steps_per_loop", steps_per_loop)
        _check_interval("checkpoint_interval", checkpoint_interval)
        _check_interval("summary_interval", summary_interval)
        if (
            isinstance(summary_interval, int)
            and isinstance(steps_per_loop, int)
            and summary_interval % steps_per_loop
        ):
            raise ValueError(
                f"summary_interval ({summary_interval}) must be a multiple of "
                f"steps_per_loop ({steps_per_loop})"
            )
        self.trainer = trainer
        self.evaluator = evaluator
        self.checkpoint_manager = checkpoint_manager
        self.steps_per_loop = steps_per_loop
        self.checkpoint_interval = checkpoint_interval
        self.summary_interval = summary_interval
        self.train_actions = list(train_actions)
        self.eval_actions = list(eval_actions)
        self.callbacks = list(callbacks)
        self.coordinator: Coordinator = coordinator if coordinator is not None else LocalCoordinator()
        self.progress = progress if self.coordinator.is_chief else False
        self._summary_dir = summary_dir
        self._eval_summary_dir = eval_summary_dir if eval_summary_dir is not None else summary_dir
        self._writers: dict[str, SummaryWriter] = {}
        self._step = 0  # global step of an evaluator-only controller (from its checkpoint)
        self._loop = _LoopState()
        self._save_pending = False
        self._closed_callbacks = False
        self.stop_reason: str | None = None
        try:
            for obj in (*self.train_actions, *self.eval_actions, *self.callbacks):
                attach = getattr(obj, "attach", None)
                if callable(attach):
                    attach(self)
            self._check_branch(restore_step)
            self.restored_step = self.restore(restore_step) if restore else None
        except BaseException:
            self._close(propagating=True)  # e.g. signal handlers installed by attach()
            raise

    # ------------------------------------------------------------------ state

    @property
    def global_step(self) -> int:
        """The trainer's global step; without a trainer, the step of the restored checkpoint."""
        return self.trainer.global_step if self.trainer is not None else self._step

    @property
    def last_eval_step(self) -> int | None:
        """The global step of the last evaluation (checkpointed); None before any."""
        return self._loop.last_eval_step

    def checkpoint_objects(self) -> dict[str, object]:
        """What a checkpoint holds: the trainer (or lone evaluator), the controller's own state,
        and (with a trainer) stateful actions and callbacks. Actions that write checkpoints
        elsewhere (``best/``) use it. An evaluator-only controller leaves its actions' state alone: the
        checkpoint's action states belong to the training run that saved them."""
        objects: dict[str, object] = {"controller": self._loop}
        runner = self.trainer if self.trainer is not None else self.evaluator
        if callable(getattr(runner, "load_checkpoint", None)):
            objects["trainer" if runner is self.trainer else "evaluator"] = runner
        if self.trainer is None:  # actions' state belongs to the training run that saved it
            return objects
        groups = (("train_actions", self.train_actions), ("eval_actions", self.eval_actions),
                  ("callbacks", self.callbacks))
        for kind, actions in groups:
            for i, action in enumerate(actions):
                if _stateful(action):
                    name = getattr(action, "checkpoint_name", None) or type(action).__name__
                    objects[f"{kind}/{i}/{name}"] = action
        return objects

    def _check_branch(self, restore_step: int | None) -> None:
        """Training from a checkpoint older than the latest would mix two runs in one directory."""
        if self.trainer is None or restore_step is None or self.checkpoint_manager is None:
            return
        later = [s for s in self.checkpoint_manager.steps() if s > restore_step]
        if later:
            raise ValueError(
                f"restore_step={restore_step} with a trainer, but checkpoints {later} exist after it: "
                "training from there would mix two runs in one model dir. Copy the checkpoint to a new "
                "model dir, or delete the later checkpoints first."
            )

    def restore(self, step: int | None = None) -> int | None:
        """Restore checkpoint ``step`` (``None``: the latest); return the restored step or None.

        Without a checkpoint manager, or when the manager has no checkpoint, nothing is restored,
        the runner's ``initialize()`` runs (if it has one) and None is returned. After a restore,
        the callbacks' ``on_checkpoint_load`` is called.
        """
        restored = None
        if self.checkpoint_manager is not None:
            restored = self.checkpoint_manager.restore(self.checkpoint_objects(), step)
        if restored is None:
            runner = self.trainer if self.trainer is not None else self.evaluator
            initialize = getattr(runner, "initialize", None)
            if callable(initialize):
                initialize()
            logger.info("no checkpoint restored: starting at step %d", self.global_step)
        else:
            self._step = restored
            self._fire("on_checkpoint_load", self.checkpoint_manager.path(restored))
        return restored

    def rollback(self) -> int:
        """Restore model, optimizer, scheduler, grad scaler and global step from the latest
        committed checkpoint, but keep the data position and RNG moving forward: the batches
        consumed since that checkpoint are skipped. Returns the step rolled back to.

        Used by NaN/loss-spike recovery. The trainer's ``load_checkpoint`` must accept the
        keywords ``restore_data`` and ``restore_rng`` (``cadence.torch.TorchTrainer`` does).

        Raises:
          ValueError: no trainer or no checkpoint manager.
          CheckpointError: there is no committed checkpoint to roll back to.
        """
        self._require("trainer", "rollback")
        self._require("checkpoint_manager", "rollback")
        restored = self.checkpoint_manager.restore({"trainer": _KeepDataPosition(self.trainer)})
        if restored is None:
            raise CheckpointError(
                f"cannot roll back: no committed checkpoint in {self.checkpoint_manager.directory}"
            )
        self._fire("on_checkpoint_load", self.checkpoint_manager.path(restored))
        return restored

    def save_checkpoint(self) -> str | None:
        """Commit a checkpoint at the current global step (no-op without a manager).

        A collective in a multi-process job: every rank calls it, the chief writes, all wait for
        the commit. Saving twice at the same step writes once. Returns the checkpoint's path.
        The callbacks' ``on_checkpoint_save`` runs for each commit reported by the manager
        (with an asynchronous manager: the commits finished so far).
        """
        if self.checkpoint_manager is None:
            return None
        self.prepare_checkpoint()
        path = self.checkpoint_manager.path(self.global_step)
        if self.coordinator.is_chief:
            # An asynchronous save in flight is waited for by save() anyway: report it first, before
            # the next commit's retention may delete it.
            self._wait_for_commits()
            path = self.checkpoint_manager.save(self.global_step, self.checkpoint_objects())
        self.coordinator.barrier()  # no rank goes on before the checkpoint is committed
        self._report_commits()
        return path

    def prepare_checkpoint(self) -> None:
        """Collective: let the trainer gather what the chief saves from every rank (its
        ``prepare_checkpoint()``, e.g. each rank's RNG state). Called on all ranks before a save."""
        prepare = getattr(self.trainer, "prepare_checkpoint", None)
        if callable(prepare):
            prepare()

    # ------------------------------------------------------------------ train

    def train(self, steps: int | None = None, *, checkpoint_at_completion: bool = True) -> None:
        """Train until the global step reaches ``steps``.

        Args:
          steps: the absolute global-step target; a no-op when already reached. ``None``: until
            the training data is exhausted (the trainer returns having advanced fewer steps than
            asked).
          checkpoint_at_completion: save a checkpoint and mark the run ``FINAL`` when done (also
            when an action raised :class:`StopTraining`).

        The callbacks' ``on_train_start`` runs first and ``on_train_end`` last (also when the
        target was already reached; see :class:`~cadence.callbacks.Callback`).

        Raises:
          ValueError: no trainer.
          RuntimeError: the trainer advanced a different number of steps than requested (with
            ``steps=None``, advancing fewer is how exhaustion is signalled and is not an error).
        """
        self._require("trainer", "train")
        self.stop_reason = None

        def run() -> None:
            if steps is not None and self.global_step >= steps:
                logger.info("train: global step %d already reached target %d", self.global_step, steps)
                return
            self._reopen_if_final(steps)
            with self._progress(steps) as progress:
                self._train_until(steps, progress, until_exhausted=steps is None)
            if checkpoint_at_completion:
                self._complete()

        self._training(run)

    def _training(self, run: Callable[[], _T]) -> _T:
        """``run()`` between the callbacks' ``on_train_start`` and ``on_train_end``. The end is
        also called on :class:`~cadence.errors.PreemptedExit` (preemption's save-and-exit), once
        that checkpoint is committed; not after any other exception."""
        self._fire("on_train_start")
        try:
            result = run()
        except PreemptedExit:
            self._wait_for_commits()
            self._fire("on_train_end")
            raise
        self._fire("on_train_end")
        return result

    def _train_until(
        self, target: int | None, progress: ProgressReporter, *, until_exhausted: bool, defer_save: bool = False
    ) -> bool:
        """Run inner loops until ``target`` (None: no target) or a stop; True if the run is over.

        "Over" means the data ran out or an action asked to stop; reaching ``target`` is not.
        ``until_exhausted``: the run trains until the data runs out, so a trainer advancing fewer
        steps than requested means exhaustion rather than an error. ``defer_save``: an interval
        checkpoint due at the last loop is left to the caller (``_save_pending``), which saves it
        after the evaluation that follows, so the eval actions' state is in it.
        """
        while (target is None or self.global_step < target) and self.stop_reason is None:
            before = self.global_step
            requested = self._loop_size(before, target)
            start = time.perf_counter()
            logs = dict(self.trainer.train(requested) or {})
            elapsed = time.perf_counter() - start
            raise_if_failed = getattr(self.checkpoint_manager, "raise_if_failed", None)
            if callable(raise_if_failed):
                raise_if_failed()  # an asynchronous save that failed surfaces at the next loop
            self._report_commits()  # asynchronous saves committed during the loop
            after = self.global_step
            advanced = after - before
            exhausted = until_exhausted and advanced < requested
            if advanced != requested and not exhausted:
                raise RuntimeError(
                    f"the trainer advanced the global step by {advanced} (from {before} to {after}) "
                    f"but {requested} steps were requested"
                    + ("; the training data may be exhausted: make the input repeat or set steps=None"
                       if advanced < requested else "")
                )
            if advanced == 0:
                return True
            logs["steps_per_second"] = advanced / elapsed if elapsed > 0 else float("inf")
            if self.summary_interval is None or _crossed(before, after, self.summary_interval):
                self._write_summary("train", self._summary_dir, after, logs)
            progress.update(after, {k: v for k, v in logs.items() if k != "steps_per_second"})
            self._run_actions(self.train_actions, logs)
            self._agree_on_stop()
            if self.global_step != after:  # an action rolled the trainer back: nothing to save
                continue
            if self.checkpoint_manager is not None and _crossed(before, after, self.checkpoint_interval):
                last = exhausted or self.stop_reason is not None or after == target
                if defer_save and last:
                    self._save_pending = True
                else:
                    self.save_checkpoint()
            if exhausted:
                logger.info("training data exhausted at step %d", after)
                return True
        return self.stop_reason is not None

    def _loop_size(self, step: int, target: int | None) -> int:
        size = self.steps_per_loop(step) if callable(self.steps_per_loop) else self.steps_per_loop
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"steps_per_loop({step}) returned {size!r}; expected an int >= 1")
        return size if target is None else min(size, target - step)

    # ------------------------------------------------------------------ evaluate

    def evaluate(self, steps: int = -1) -> dict[str, Any]:
        """Evaluate the current model state and return its metrics.

        Args:
          steps: batches to evaluate; ``-1`` until the eval data is exhausted.

        Writes eval summaries at the current global step, runs the eval actions, then the
        callbacks' ``on_eval_end(metrics, step)``. An eval action
        that raises :class:`StopTraining` sets :attr:`stop_reason`: a running
        ``train_and_evaluate`` then ends cleanly; ``evaluate`` itself returns normally.

        Raises:
          ValueError: no evaluator, or ``steps`` neither -1 nor >= 1.
        """
        self._require("evaluator", "evaluate")
        if not isinstance(steps, int) or isinstance(steps, bool) or (steps != -1 and steps < 1):
            raise ValueError(f"evaluate: steps must be -1 (all) or an int >= 1, got {steps!r}")
        start = time.perf_counter()
        metrics = dict(self.evaluator.evaluate(steps) or {})
        elapsed = time.perf_counter() - start
        step = self.global_step
        self._loop.last_eval_step = step
        self._write_summary("eval", self._eval_summary_dir, step, metrics)
        shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
        logger.info("eval at step %d (%.1fs): %s", step, elapsed, shown)
        self._run_actions(self.eval_actions, metrics)
        self._fire("on_eval_end", metrics, step)
        return metrics

    def evaluate_continuously(
        self,
        steps: int = -1,
        timeout: float | None = None,
        timeout_fn: Callable[[], bool] | None = None,
        *,
        mode: str = "latest",
        poll_interval: float = 1.0,
    ) -> dict[str, Any] | None:
        """Evaluate checkpoints as they are committed; return the last evaluation's metrics.

        Orbit's contract: waits for new checkpoints, polling every ``poll_interval`` seconds;
        ``mode="latest"`` evaluates the newest one each time (checkpoints written during a slow
        evaluation are skipped), ``mode="every"`` each one in step order. After ``timeout``
        seconds without a new checkpoint, ``timeout_fn()`` decides: True (or no ``timeout_fn``)
        stops, False keeps waiting; ``timeout=None`` waits for ever. Unlike Orbit, it also stops
        once the final checkpoint (``checkpoints/FINAL``) has been evaluated. A checkpoint that
        cannot be read is reported and skipped. Returns None when nothing was evaluated.

        For a separate evaluator process with leases, progress that survives restarts and
        retries, use :class:`cadence.sidecar.SidecarEvaluator`.

        Raises:
          ValueError: no evaluator or no checkpoint manager.
        """
        from cadence.checkpoint.watcher import CheckpointWatcher

        self._require("evaluator", "evaluate_continuously")
        self._require("checkpoint_manager", "evaluate_continuously")
        watcher = CheckpointWatcher(self.checkpoint_manager, mode=mode, poll_interval=poll_interval,
                                    timeout=timeout, timeout_fn=timeout_fn)
        output = None
        for step in watcher:
            try:
                self.restore(step)
            except CheckpointError as e:
                logger.warning("skipping checkpoint %d: %s", step, e)
                continue
            output = self.evaluate(steps)
        logger.info("evaluate_continuously: stopped (%s) after step %s", watcher.stop_reason, watcher.after)
        return output

    # ------------------------------------------------------------------ both

    def train_and_evaluate(
        self,
        train_steps: int | None = None,
        eval_steps: int = -1,
        eval_interval: int | None = None,
        *,
        throttle_secs: float = 0.0,
        start_delay_secs: float = 0.0,
    ) -> dict[str, Any]:
        """Alternate training and evaluation; return the last evaluation's metrics.

        Args:
          train_steps: absolute global-step target; ``None``: until the training data is exhausted.
          eval_steps: batches per evaluation (``-1``: all).
          eval_interval: evaluate whenever the global step reaches a multiple of it (segments are
            cut at absolute multiples, so resumed runs evaluate at the same steps). ``None``:
            evaluate once, at the end.
          throttle_secs: tf.estimator's ``EvalSpec.throttle_secs``: an evaluation due less than
            this many seconds after the previous one started is skipped. 0: never skipped.
          start_delay_secs: tf.estimator's ``EvalSpec.start_delay_secs``: evaluations due in the
            first this many seconds of the call are skipped. 0: none. The final evaluation is
            never skipped by either (tf.estimator also always evaluates after the last step).

        Each segment ends with an evaluation, *then* the checkpoint due at that step (interval or
        final), so a checkpoint at step N holds the eval actions' state after the evaluation at
        N. A run resumed at an evaluation step whose evaluation never ran (it was preempted right
        before it) evaluates first. At the end (target reached, data exhausted, or
        :class:`StopTraining` from an action) the final checkpoint is saved and ``FINAL``
        written. A run that is already complete is evaluated once. The callbacks'
        ``on_train_start`` runs first and ``on_train_end`` last, as in :meth:`train`.
        """
        self._require("trainer", "train_and_evaluate")
        self._require("evaluator", "train_and_evaluate")
        _check_interval("eval_interval", eval_interval)
        self.stop_reason = None
        self._reopen_if_final(train_steps)
        if throttle_secs < 0 or start_delay_secs < 0:
            raise ValueError(f"throttle_secs and start_delay_secs must be >= 0, got {throttle_secs}, {start_delay_secs}")
        return self._training(lambda: self._train_and_evaluate(
            train_steps, eval_steps, eval_interval, throttle_secs, start_delay_secs))

    def _train_and_evaluate(self, train_steps: int | None, eval_steps: int, eval_interval: int | None,
                            throttle_secs: float, start_delay_secs: float) -> dict[str, Any]:
        started = time.monotonic()
        last_eval: list[float] = []  # when the last evaluation of this call started

        def evaluate() -> dict[str, Any]:
            last_eval[:] = [time.monotonic()]
            return self.evaluate(eval_steps)

        def throttled() -> bool:
            now = time.monotonic()
            return now - started < start_delay_secs or bool(last_eval and now - last_eval[0] < throttle_secs)

        output: dict[str, Any] | None = None
        step = self.global_step
        if eval_interval is not None and step > 0 and step % eval_interval == 0 and self.last_eval_step != step:
            output = evaluate()
        over = (train_steps is not None and step >= train_steps) or self.stop_reason is not None
        with self._progress(train_steps) as progress:
            while not over:
                step = self.global_step
                target = train_steps
                if eval_interval is not None:
                    boundary = (step // eval_interval + 1) * eval_interval
                    target = boundary if target is None else min(target, boundary)
                over = self._train_until(target, progress, until_exhausted=train_steps is None, defer_save=True)
                over = over or (train_steps is not None and self.global_step >= train_steps)
                if over or not throttled():
                    output = evaluate()
                else:
                    logger.info("evaluation at step %d skipped (start_delay_secs / throttle_secs)", self.global_step)
                self._agree_on_stop()
                over = over or self.stop_reason is not None
                if self._save_pending and not over:
                    self.save_checkpoint()
                self._save_pending = False
        if output is None or self.last_eval_step != self.global_step:
            output = evaluate()
        self._complete()
        return output

    # ------------------------------------------------------------------ helpers

    def _require(self, role: str, method: str) -> None:
        if getattr(self, role) is None:
            raise ValueError(f"Controller.{method}() needs a {role}; this controller was built without one")

    def _run_actions(self, actions: list[Action], output: dict[str, Any]) -> None:
        for action in actions:
            try:
                action(output)
            except StopTraining as stop:
                self.stop_reason = stop.reason
                logger.info("stop requested at step %d: %s", self.global_step, stop.reason)

    def _fire(self, hook: str, *args: Any) -> None:
        """Call ``hook(*args)`` on every callback that has it, in order."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(*args)

    def _report_commits(self) -> None:
        """Tell the callbacks about the checkpoints the manager committed since the last time."""
        take = getattr(self.checkpoint_manager, "take_committed", None)
        if not callable(take):
            return
        for _, path in take():
            self._fire("on_checkpoint_save", path)

    def _wait_for_commits(self) -> None:
        """Wait for an asynchronous save in flight, then report the commits."""
        wait = getattr(self.checkpoint_manager, "wait", None)
        if callable(wait):
            wait()
        self._report_commits()

    def _agree_on_stop(self) -> None:
        """Collective (several ranks): a stop asked for on any rank stops every rank."""
        if self.coordinator.world_size > 1 and self.coordinator.any(self.stop_reason is not None):
            if self.stop_reason is None:
                self.stop_reason = "stop requested on another rank"

    def _complete(self) -> None:
        """Save the final checkpoint and mark the run FINAL."""
        if self.checkpoint_manager is None:
            return
        self.save_checkpoint()
        if self.coordinator.is_chief:
            self.checkpoint_manager.mark_final(self.global_step)  # waits for an asynchronous commit
        self._report_commits()

    def _reopen_if_final(self, target: int | None) -> None:
        """A run marked FINAL that trains further is no longer final: remove the marker."""
        manager = self.checkpoint_manager
        if manager is None or not self.coordinator.is_chief:
            return
        final = manager.final_step()
        if final is not None and (target is None or target > final):
            manager.clear_final()

    def _progress(self, total: int | None) -> ProgressReporter:
        return ProgressReporter(total, initial_step=self.global_step, enabled=self.progress)

    def _write_summary(self, kind: str, logdir: str | None, step: int, metrics: Mapping[str, Any]) -> None:
        if logdir is None or not self.coordinator.is_chief:
            return
        key = f"{kind}:{logdir}"
        if key not in self._writers:
            self._writers[key] = SummaryWriter(logdir)
        writer = self._writers[key]
        writer.write(step, metrics)
        writer.flush()

    def close(self) -> None:
        """Wait for a pending asynchronous checkpoint (raising its failure) and report the
        commits to the callbacks, flush and close summary writers, call ``close()`` on actions
        that have one, and the callbacks' ``on_close`` (once) -- the last three always.

        An ``on_close`` that raises does not stop the others; the first such error is raised
        after all ran, unless the closing itself failed. Leaving a ``with controller:`` block
        on an exception never replaces that exception with an ``on_close`` error (it is logged).
        """
        self._close(propagating=False)

    def _close(self, propagating: bool) -> None:
        try:
            try:
                close_manager = getattr(self.checkpoint_manager, "close", None)
                if callable(close_manager):
                    close_manager()
                self._report_commits()
            finally:
                for writer in self._writers.values():
                    writer.close()
                self._writers.clear()
                for action in (*self.train_actions, *self.eval_actions):
                    close = getattr(action, "close", None)
                    if callable(close):
                        close()
        except BaseException:
            self._close_callbacks(raise_errors=False)
            raise
        self._close_callbacks(raise_errors=not propagating)

    def _close_callbacks(self, *, raise_errors: bool) -> None:
        """Every callback's ``on_close``, once; errors are logged, the first raised if asked."""
        if self._closed_callbacks:
            return
        self._closed_callbacks = True
        first: BaseException | None = None
        for callback in self.callbacks:
            on_close = getattr(callback, "on_close", None)
            if not callable(on_close):
                continue
            try:
                on_close()
            except BaseException as e:  # the other callbacks still close
                logger.exception("callback %s: on_close failed", type(callback).__name__)
                first = first if first is not None else e
        if first is not None and raise_errors:
            raise first

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._close(propagating=exc_type is not None)
