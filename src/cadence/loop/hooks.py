"""Dispatching a run's events to its callbacks, and closing them: :class:`CallbackHooks`."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from cadence.callbacks import Callback
from cadence.errors import PreemptedExit

logger = logging.getLogger("cadence")

__all__ = ["CallbackHooks"]


class CallbackHooks:
    """The run's :class:`~cadence.callbacks.Callback` objects, told of each event in order.

    Raises:
      TypeError: (on construction) an object that is not a ``Callback``.
    """

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.callbacks = list(callbacks)
        for i, callback in enumerate(self.callbacks):
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks[{i}]: expected a cadence.Callback (subclass it and override the "
                                f"hooks you need), got {type(callback).__name__}")
        self._closed = False

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
            callback.on_train_start()

    def train_end(self) -> None:
        for callback in self.callbacks:
            callback.on_train_end()

    def train_logs(self, logs: dict[str, Any], step: int) -> None:
        for callback in self.callbacks:
            callback.on_train_logs(logs, step)

    def checkpoint_save(self, checkpoint_dir: str) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_save(checkpoint_dir)

    def checkpoint_load(self, checkpoint_dir: str) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_load(checkpoint_dir)

    def eval_end(self, metrics: dict[str, Any], step: int) -> None:
        for callback in self.callbacks:
            callback.on_eval_end(metrics, step)

    def close(self, *, raise_errors: bool) -> None:
        """Every callback's ``on_close``, once (later calls do nothing). An error is logged and
        does not stop the others; the first is raised after all ran when ``raise_errors``."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for callback in self.callbacks:
            try:
                callback.on_close()
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
