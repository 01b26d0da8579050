"""When the loop acts: interval crossings, evaluation segments and tf.estimator's throttling.

Pure bookkeeping, no I/O (but a log line): the :class:`~cadence.Controller` asks these how long
an inner loop is, when to write summaries, save, and evaluate.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from cadence.extensions import PlansSteps

logger = logging.getLogger("cadence")

__all__ = ["EvalState", "EvalThrottle", "already_reached", "check_advance", "check_interval", "check_loop_settings",
           "crossed", "loop_size", "progress_total", "segment_target"]


def check_interval(name: str, value: int | None) -> None:
    """Raise ValueError unless ``value`` is None or an int >= 1 (``name`` starts the message)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def check_loop_settings(steps_per_loop: int | Callable[[int], int] | None, checkpoint_interval: int | None,
                        summary_interval: int | None, *, training: bool) -> None:
    """Raise ValueError for a loop that cannot run: ``steps_per_loop`` missing (``training``)
    or not an int >= 1 (a callable is checked at each loop), a bad interval, or a
    ``summary_interval`` that is not a multiple of an int ``steps_per_loop``."""
    if training:
        if steps_per_loop is None:
            raise ValueError("steps_per_loop is required when a trainer is given")
        if not callable(steps_per_loop):
            check_interval("steps_per_loop", steps_per_loop)
    check_interval("checkpoint_interval", checkpoint_interval)
    check_interval("summary_interval", summary_interval)
    if isinstance(summary_interval, int) and isinstance(steps_per_loop, int) and summary_interval % steps_per_loop:
        raise ValueError(f"summary_interval ({summary_interval}) must be a multiple of "
                         f"steps_per_loop ({steps_per_loop})")


def check_advance(before: int, after: int, requested: int, *, until_exhausted: bool) -> bool:
    """Whether the training data ran out in a loop asked for ``requested`` steps that moved the
    global step from ``before`` to ``after``: fewer steps, when training ``until_exhausted``.

    Raises:
      RuntimeError: the trainer advanced another number of steps than requested, otherwise.
    """
    advanced = after - before
    exhausted = until_exhausted and advanced < requested
    if advanced != requested and not exhausted:
        raise RuntimeError(
            f"the trainer advanced the global step by {advanced} (from {before} to {after}) "
            f"but {requested} steps were requested"
            + ("; the training data may be exhausted: make the input repeat or set steps=None"
               if advanced < requested else ""))
    return exhausted


def crossed(before: int, after: int, interval: int | None) -> bool:
    """True when a multiple of ``interval`` lies in ``(before, after]``; False for None."""
    return interval is not None and after // interval > before // interval


def segment_target(step: int, train_steps: int | None, eval_interval: int | None) -> int | None:
    """Where the training segment starting at ``step`` ends: the next absolute multiple of
    ``eval_interval`` (so a resumed run evaluates at the same steps), capped at ``train_steps``.
    None: no end but the data's."""
    if eval_interval is None:
        return train_steps
    boundary = (step // eval_interval + 1) * eval_interval
    return boundary if train_steps is None else min(train_steps, boundary)


class EvalState:
    """The loop's checkpointed state: the global step of the last evaluation (None before any).

    Saved under ``controller`` in every checkpoint, so a run preempted right before an
    evaluation runs it on resume."""

    def __init__(self) -> None:
        self.last_eval_step: int | None = None

    def due_on_resume(self, step: int, eval_interval: int | None) -> bool:
        """Whether ``step`` is an evaluation step whose evaluation never ran."""
        return (eval_interval is not None and step > 0 and step % eval_interval == 0
                and self.last_eval_step != step)

    def state_dict(self) -> dict[str, Any]:
        return {"last_eval_step": self.last_eval_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_eval_step = state.get("last_eval_step")


class EvalThrottle:
    """tf.estimator's ``EvalSpec`` throttling of in-process evaluations, for one call of
    ``train_and_evaluate``.

    Args:
      throttle_secs: an evaluation due less than this many seconds after the previous one
        *started* is skipped. 0: never.
      start_delay_secs: evaluations due in the first this many seconds are skipped. 0: none.
      clock: monotonic seconds; None: ``time.monotonic``.

    The final evaluation is never skipped (the caller does not ask). Raises ValueError for a
    negative value.
    """

    def __init__(self, throttle_secs: float = 0.0, start_delay_secs: float = 0.0,
                 clock: Callable[[], float] | None = None) -> None:
        if throttle_secs < 0 or start_delay_secs < 0:
            raise ValueError(
                f"throttle_secs and start_delay_secs must be >= 0, got {throttle_secs}, {start_delay_secs}")
        self.throttle_secs = throttle_secs
        self.start_delay_secs = start_delay_secs
        self._clock = clock or time.monotonic
        self._started = self._clock()
        self._last: float | None = None

    def skips(self) -> bool:
        """Whether an evaluation due now is skipped."""
        now = self._clock()
        if now - self._started < self.start_delay_secs:
            return True
        return self._last is not None and now - self._last < self.throttle_secs

    def evaluating(self) -> None:
        """Note that an evaluation starts now."""
        self._last = self._clock()


def loop_size(steps_per_loop: int | Callable[[int], int] | None, step: int, target: int | None) -> int:
    """The steps of the inner loop starting at ``step``: ``steps_per_loop`` (called with ``step``
    when callable), at most up to ``target`` (None: no target). ValueError for a callable that
    returns anything but an int >= 1."""
    size = steps_per_loop(step) if callable(steps_per_loop) else steps_per_loop
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"steps_per_loop({step}) returned {size!r}; expected an int >= 1")
    return size if target is None else min(size, target - step)


def already_reached(step: int, target: int | None, *, saved: bool) -> bool:
    """Whether the global ``step`` is at ``target`` already (logged), or past it (a warning: a run
    resumed with a lower ``train_steps`` has nothing to train). ``saved``: the run has a
    checkpoint manager (the warning then names the model dir)."""
    if target is None or step < target:
        return False
    if step == target:
        logger.info("train: global step %d already reached target %d", step, target)
    else:
        where = "the model dir has" if saved else "the trainer has"
        logger.warning("%s trained to step %d, past train_steps=%d: nothing to train", where, step, target)
    return True


def progress_total(trainer: object, target: int | None) -> int | None:
    """The progress display's total: the step ``target`` (None: none), or a
    :class:`~cadence.extensions.PlansSteps` trainer's planned end when that is known and earlier."""
    planned = trainer.planned_steps if isinstance(trainer, PlansSteps) else None
    if planned is None:
        return target
    return planned if target is None else min(target, planned)
