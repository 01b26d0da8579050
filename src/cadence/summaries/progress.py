"""Progress reporting for training and evaluation loops.

On a terminal, :class:`ProgressReporter` draws a rich progress bar: ``step/total``, percentage,
steps/s, ETA, the latest loop's throughput (:mod:`cadence.summaries.throughput`) and scalar logs. Elsewhere
(CI, pipes, log files) it prints plain lines at most every ``log_interval_s`` seconds, and a last
one at :meth:`ProgressReporter.close`. Every rate on the line is the latest loop's when the logs
carry its ``steps_per_second`` (the controller's do: the summaries' rates, one window), so steps/s
times the samples per step is samples/s; the ETA is the remaining steps at that rate::

    step 200/600 (33%)  12.3 steps/s  eta 0:00:32  1.57k samples/s  MFU 41.2%  loss=0.1234  accuracy=0.91
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from cadence.summaries.scalars import flatten_scalars
from cadence.summaries.throughput import MEMORY_KEYS, RATE_KEYS, format_throughput

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, Task, TaskID

__all__ = ["ProgressReporter", "format_duration", "format_logs", "format_rate", "format_value"]

_monotonic = time.monotonic  # indirection so tests can drive the clock


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (hours unbounded), rounded to the second; ``"?"`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_rate(steps_per_s: float | None) -> str:
    """``"12.3 steps/s"``, or ``"4.2 s/step"`` below one step per second; ``""`` when unknown."""
    if steps_per_s is None or not math.isfinite(steps_per_s) or steps_per_s <= 0:
        return ""
    if steps_per_s >= 1:
        return f"{steps_per_s:.1f} steps/s"
    return f"{1 / steps_per_s:.1f} s/step"


def format_value(value: Any) -> str:
    """A metric for people: a float to 4 significant digits, anything else as ``str()``."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_logs(logs: Mapping[str, Any] | None) -> str:
    """The scalar logs as ``key=value`` pairs (4 significant digits), two spaces apart."""
    if not logs:
        return ""
    return "  ".join(f"{k}={format_value(v)}" for k, v in flatten_scalars(logs).items())


STEPS_PER_SECOND = "steps_per_second"
"""The loop's rate in its logs: shown as the line's steps/s (and the ETA's rate) when present."""
_THROUGHPUT_KEYS = frozenset((*RATE_KEYS, *MEMORY_KEYS, STEPS_PER_SECOND))


def _default_enabled() -> bool:
    """Report only on the main process of a distributed run (``RANK`` unset or ``0``)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


class ProgressReporter:
    """Reports a loop's progress: a rich bar on a terminal, periodic plain lines elsewhere.

    ``total_steps=None`` shows no percentage or ETA. ``enabled=None`` enables it unless this is
    a non-zero rank of a distributed run (``RANK`` set and not ``0``); ``enabled=False`` is silent.
    ``console`` defaults to a rich console on stderr. The steps/s shown is the logs'
    ``steps_per_second`` (the latest loop's, as its other rates) when they have it, else measured here:
    since the last line, and since the start on the closing line.
    """

    def __init__(
        self,
        total_steps: int | None,
        *,
        initial_step: int = 0,
        enabled: bool | None = None,
        console: Console | None = None,
        log_interval_s: float = 10.0,
    ) -> None:
        self.total_steps = total_steps
        self.enabled = _default_enabled() if enabled is None else bool(enabled)
        self.log_interval_s = float(log_interval_s)
        if console is None and self.enabled:
            from rich.console import Console

            console = Console(stderr=True)
        self._console = console
        self._terminal = bool(console is not None and (console.is_terminal or console.is_jupyter))
        self._closed = False
        self._step = initial_step
        self._logs = ""
        self._loop_rate: float | None = None  # the logs' steps_per_second
        # plain-line mode state
        self._start_time = _monotonic()
        self._start_step = initial_step
        self._last_update_time = self._start_time
        self._last_print_time = self._start_time
        self._last_print_step = initial_step
        # terminal mode state
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    @property
    def step(self) -> int:
        """The latest step reported."""
        return self._step

    # -- public API ----------------------------------------------------------------------------

    def update(self, step: int, logs: Mapping[str, Any] | None = None) -> None:
        """Report that ``step`` was reached; ``logs`` (if given) replace the logs shown."""
        if not self.enabled or self._closed:
            return
        if logs is not None:
            rates = format_throughput(logs)  # samples/s, tokens/s, MFU, peak memory: first, in their units
            rest = format_logs({k: v for k, v in logs.items() if k not in _THROUGHPUT_KEYS})
            self._logs = "  ".join(part for part in (rates, rest) if part)
            rate = logs.get(STEPS_PER_SECOND)
            self._loop_rate = float(rate) if isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0 else None
        now = _monotonic()
        rolled_back = step < self._step
        if rolled_back:  # e.g. NaN recovery: restart the rate estimate from here
            self._start_time, self._start_step = now, step
            self._last_print_time, self._last_print_step = now, step
        self._step = step
        self._last_update_time = now
        if self._terminal:
            self._update_bar(step, rolled_back)
        elif now - self._last_print_time >= self.log_interval_s:
            rate = self._loop_rate or self._rate_since(self._last_print_step, self._last_print_time, now)
            self._emit(self._line(rate))
            self._last_print_time, self._last_print_step = now, step

    def message(self, text: str) -> None:
        """Print ``text`` as its own line (above the bar on a terminal)."""
        if not self.enabled or self._console is None:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, emoji=False)
        else:
            self._emit(text)

    def close(self) -> None:
        """Finish: leave the final bar on screen, or print a last line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif not self._terminal:
            rate = self._loop_rate or self._rate_since(self._start_step, self._start_time, self._last_update_time)
            elapsed = self._last_update_time - self._start_time
            self._emit(self._line(rate, final_elapsed=elapsed))

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain lines ---------------------------------------------------------------------------

    def _rate_since(self, step0: int, time0: float, now: float) -> float | None:
        """Steps per second from ``(step0, time0)`` to the current step at ``now``."""
        dt = now - time0
        return None if dt <= 0 else (self._step - step0) / dt

    def _line(self, rate: float | None, final_elapsed: float | None = None) -> str:
        parts = [self._position()]
        if rate_text := format_rate(rate):
            parts.append(rate_text)
        if final_elapsed is not None:
            parts.append(f"elapsed {format_duration(final_elapsed)}")
        elif self.total_steps is not None and rate:
            remaining = max(0, self.total_steps - self._step)
            parts.append(f"eta {format_duration(remaining / rate)}")
        if self._logs:
            parts.append(self._logs)
        return "  ".join(parts)

    def _position(self) -> str:
        if self.total_steps is None:
            return f"step {self._step}"
        pct = 100 * self._step / self.total_steps if self.total_steps > 0 else 100
        return f"step {self._step}/{self.total_steps} ({pct:.0f}%)"

    def _emit(self, line: str) -> None:
        assert self._console is not None
        self._console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)

    # -- terminal bar --------------------------------------------------------------------------

    def _update_bar(self, step: int, rolled_back: bool) -> None:
        if self._progress is None:
            self._start_bar()
        assert self._progress is not None and self._task is not None
        if rolled_back:
            self._progress.reset(
                self._task, total=self.total_steps, completed=step, logs=self._logs, rate=self._loop_rate
            )
        else:
            self._progress.update(self._task, completed=step, logs=self._logs, rate=self._loop_rate)

    def _start_bar(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
        )
        from rich.table import Column

        self._progress = Progress(
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            _rate_column(),
            _eta_column(),
            TextColumn(
                "{task.fields[logs]}", table_column=Column(no_wrap=True, overflow="ellipsis")
            ),
            console=self._console,
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=self.total_steps, completed=self._start_step, logs=self._logs, rate=self._loop_rate
        )
        self._progress.start()


@functools.cache
def _rich_columns() -> tuple[type, type]:
    """The two custom rich columns, defined on first use so rich loads only when drawing."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Steps per second (or seconds per step): the latest loop's, else rich's estimate."""

        def render(self, task: Task) -> Text:
            return Text(format_rate(_speed(task)), style="progress.data.speed")

    class EtaColumn(ProgressColumn):
        """Estimated time to completion; empty without a total."""

        max_refresh = 0.5

        def render(self, task: Task) -> Text:
            if task.total is None:
                return Text("")
            if task.finished:
                return Text(
                    f"elapsed {format_duration(task.finished_time or task.elapsed)}",
                    style="progress.elapsed",
                )
            rate, remaining = _speed(task), task.remaining
            eta = remaining / rate if rate and remaining is not None else None
            return Text(f"eta {format_duration(eta)}", style="progress.remaining")

    return RateColumn, EtaColumn


def _speed(task: Task) -> float | None:
    """The task's steps/s: the latest loop's (its ``rate`` field) when known, else rich's estimate."""
    rate = task.fields.get("rate")
    return float(rate) if rate else task.speed


def _rate_column() -> Any:
    return _rich_columns()[0]()


def _eta_column() -> Any:
    return _rich_columns()[1]()
