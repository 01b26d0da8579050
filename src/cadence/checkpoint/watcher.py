"""Yield committed checkpoints as they appear: the machinery under continuous evaluation."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Literal

from cadence.checkpoint.manager import CheckpointManager

Mode = Literal["every", "latest"]
StopReason = Literal["final", "timeout", "stopped"]


class CheckpointWatcher:
    """Iterates over the steps of new committed checkpoints, polling ``manager``.

    Args:
      manager: the model dir's checkpoint manager (a reader: ``writer=False``).
      mode: ``"every"`` yields each committed checkpoint after ``after`` in step order, including
        those that existed before the watch started; ``"latest"`` yields only the newest one each
        time (checkpoints written meanwhile are skipped: Orbit's and Keras' behaviour).
      poll_interval: seconds between looks while nothing is new. (Both have no default here: the
        sidecar's settings, :class:`~cadence.config.SidecarConfig`, own them.)
      timeout: stop after this many seconds without a new checkpoint; ``None``: wait for ever
        (unless the run is final).
      timeout_fn: called on timeout: True (or no ``timeout_fn``) stops, False waits another
        ``timeout`` (Orbit's contract).
      after: only checkpoints with a larger step are new (``None``: all are). The consumer may
        move it forward (e.g. to release pending checkpoints).
      train_steps: a step ``>=`` this is final even without ``FINAL``.
      should_stop: polled between looks; True stops the watch (``stop_reason="stopped"``).

    The watch ends with :attr:`stop_reason`: ``"final"`` once the final checkpoint (named by
    ``checkpoints/FINAL``, or a step ``>= train_steps``) has been yielded and nothing newer is
    pending, ``"timeout"``, or ``"stopped"``. A consumer iterating lazily sees a checkpoint at most
    ``poll_interval`` seconds after its commit.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        mode: Mode,
        poll_interval: float,
        timeout: float | None = None,
        timeout_fn: Callable[[], bool] | None = None,
        after: int | None = None,
        train_steps: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if mode not in ("every", "latest"):
            raise ValueError(f"mode must be 'every' or 'latest', got {mode!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        self.manager = manager
        self.mode = mode
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.timeout_fn = timeout_fn
        self.after = after
        self.train_steps = train_steps
        self.should_stop = should_stop
        self.stop_reason: StopReason | None = None
        self._clock = clock
        self._sleep = sleep

    def pending(self) -> list[int]:
        """Committed steps after :attr:`after`, ascending."""
        return [s for s in self.manager.steps() if self.after is None or s > self.after]

    def final_step(self) -> int | None:
        """The step that ends the run: ``FINAL``'s, else None (``train_steps`` is checked apart)."""
        return self.manager.final_step()

    def _done(self) -> bool:
        if self.after is None:
            return False
        if self.train_steps is not None and self.after >= self.train_steps:
            return True
        final = self.final_step()
        return final is not None and self.after >= final

    def __iter__(self) -> Iterator[int]:
        last_new = self._clock()
        while True:
            if self.should_stop is not None and self.should_stop():
                self.stop_reason = "stopped"
                return
            pending = self.pending()
            if pending:
                step = pending[0] if self.mode == "every" else pending[-1]
                self.after = step
                yield step
                last_new = self._clock()
                continue
            if self._done():
                self.stop_reason = "final"
                return
            if self.timeout is not None and self._clock() - last_new >= self.timeout:
                if self.timeout_fn is None or self.timeout_fn():
                    self.stop_reason = "timeout"
                    return
                last_new = self._clock()
            self._sleep(self.poll_interval)
