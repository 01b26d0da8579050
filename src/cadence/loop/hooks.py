"""Dispatching a run's events to its callbacks, each with the run, and closing them: :class:`CallbackHooks`."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from cadence.errors import PreemptedExit
from cadence.extensions import Callback, ReportsSteps, RunContext, StepEnd, Trainer, overrides_step_end

logger = logging.getLogger("cadence")

__all__ = ["CallbackHooks"]


class CallbackHooks:
    """The :class:`~cadence.extensions.Callback` objects of ``run``, told of each event in order,
    each hook called with ``run``.

    Raises:
      TypeError: (on construction) an object that is not a ``Callback``.
    """

    def __init__(self, callbacks: Iterable[Callback], run: RunContext) -> None:
        self.callbacks = list(callbacks)
        for i, callback in enumerate(self.callbacks):
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks[{i}]: expected a cadence.Callback (subclass it and override the "
                                f"hooks you need), got {type(callback).__name__}")
        self.run = run
        self._closed = False

    def step_end(self) -> StepEnd | None:
        """What the trainer calls after each optimizer step: ``on_train_step_end(run, step)`` of
        the callbacks whose class overrides it, in order; None when none does."""
        run = self.run
        stepping = [c.on_train_step_end for c in self.callbacks if overrides_step_end(c)]
        if not stepping:
            return None
        if len(stepping) == 1:
            (only,) = stepping
            return lambda step: only(run, step)

        def step_end(step: int) -> None:
            for hook in stepping:
                hook(run, step)

        return step_end

    def hand_step_end(self, trainer: Trainer | None) -> None:
        """Give a :class:`~cadence.extensions.ReportsSteps` trainer :meth:`step_end` (None: no
        per-step callback). Decided once, when the run is built.

        Raises:
          TypeError: a per-step callback, and a trainer that is not ``ReportsSteps``.
        """
        step_end = self.step_end()
        if isinstance(trainer, ReportsSteps):
            trainer.set_step_end(step_end)
        elif trainer is not None and step_end is not None:
            stepping = [type(c).__name__ for c in self.callbacks if overrides_step_end(c)]
            raise TypeError(f"callbacks {stepping} override on_train_step_end, and the trainer "
                            f"({type(trainer).__name__}) cannot report steps: it must implement "
                            "cadence.extensions.ReportsSteps (set_step_end)")

    @contextmanager
    def training(self, *, on_preempted: Callable[[], None]) -> Iterator[None]:
        """``on_train_start`` on entry, ``on_train_end`` on a normal exit -- and on
        :class:`~cadence.errors.PreemptedExit` (preemption's save-and-exit), after
        ``on_preempted()`` (which waits for that checkpoint's commit) -- not after other errors."""
        self.train_start()
        try:
            yield
        except PreemptedExit:
            on_preempted()
            self.train_end()
            raise
        self.train_end()

    def train_start(self) -> None:
        for callback in self.callbacks:
            callback.on_train_start(self.run)

    def train_end(self) -> None:
        for callback in self.callbacks:
            callback.on_train_end(self.run)

    def train_logs(self, logs: dict[str, Any], step: int) -> None:
        for callback in self.callbacks:
            callback.on_train_logs(self.run, logs, step)

    def checkpoint_save(self, checkpoint_dir: str) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_save(self.run, checkpoint_dir)

    def checkpoint_load(self, checkpoint_dir: str) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_load(self.run, checkpoint_dir)

    def eval_end(self, metrics: dict[str, Any], step: int) -> None:
        for callback in self.callbacks:
            callback.on_eval_end(self.run, metrics, step)

    def close(self, *, raise_errors: bool) -> None:
        """Every callback's ``on_close``, once (later calls do nothing). An error is logged and
        does not stop the others; the first is raised after all ran when ``raise_errors``."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for callback in self.callbacks:
            try:
                callback.on_close(self.run)
            except BaseException as e:  # the other callbacks still close
                logger.exception("callback %s: on_close failed", type(callback).__name__)
                first = first if first is not None else e
        if first is not None and raise_errors:
            raise first

    def close_run(self, *steps: Callable[[], None], propagating: bool) -> None:
        """Close a run: the first step (waiting for the last checkpoint) and then, always, each
        other step in order, then the callbacks' ``on_close`` (:meth:`close`). An error from a
        step propagates after the callbacks closed; an ``on_close`` error is raised only when
        nothing else is (``propagating``: an exception is already on its way out)."""
        first, *rest = steps
        try:
            try:
                first()
            finally:
                for step in rest:
                    step()
        except BaseException:
            self.close(raise_errors=False)
            raise
        self.close(raise_errors=not propagating)
