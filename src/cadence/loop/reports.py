"""What the loop reports as it goes: :class:`LoopReports`.

After each inner loop: the rates (``steps_per_second``; with a
:class:`~cadence.summaries.throughput.CountsWork` trainer samples/s, tokens/s and MFU over the same
elapsed time), the train summaries when due (TensorBoard + ``metrics.jsonl``, the chief's) and the
callbacks' ``on_train_logs``, and the progress line. After each evaluation: the eval summaries and
one log line. The controller decides *when*; this module only says *what*.
"""

from __future__ import annotations

import logging
from typing import Any

from cadence.loop.hooks import CallbackHooks
from cadence.loop.schedule import crossed
from cadence.summaries.manager import SummaryManager
from cadence.summaries.progress import ProgressReporter, format_logs
from cadence.summaries.throughput import CountsWork, throughput_logs

logger = logging.getLogger("cadence")

__all__ = ["LoopReports"]


class LoopReports:
    """The train and eval summaries of one controller, and what goes with them.

    ``summary_dir`` / ``eval_dir``: where the summaries go (None: none); only the chief writes.
    ``summary_interval``: train summaries after a loop that crossed a multiple of it (None: every
    loop)."""

    def __init__(self, summary_dir: str | None, eval_dir: str | None, *, chief: bool, summary_interval: int | None,
                 hooks: CallbackHooks) -> None:
        self.train = SummaryManager(summary_dir, enabled=chief and summary_dir is not None)
        self.eval = SummaryManager(eval_dir, enabled=chief and eval_dir is not None)
        self.separate_eval = eval_dir != summary_dir
        self.summary_interval = summary_interval
        self._hooks = hooks

    def resume_at(self, step: int, *, evaluates: bool) -> None:
        """Drop what a killed run summarized past ``step``; the eval records only when this
        controller evaluates into a directory of its own (a sidecar's records stay)."""
        self.train.resume_at(step)
        if evaluates and self.separate_eval:
            self.eval.resume_at(step)

    def after_loop(self, trainer: object, before: int, after: int, logs: dict[str, Any], elapsed: float,
                   progress: ProgressReporter) -> None:
        """Complete ``logs`` (in place) with the loop's rates, write them when due, tell the
        callbacks, and show them on the progress line."""
        logs["steps_per_second"] = (after - before) / elapsed if elapsed > 0 else float("inf")
        if isinstance(trainer, CountsWork):
            logs.update(throughput_logs(trainer.loop_work(), elapsed))
        if self.summary_interval is None or crossed(before, after, self.summary_interval):
            self.train.write_summaries(after, logs)
            self.train.flush()
            self._hooks.train_logs(logs, after)
        progress.update(after, logs)  # its steps/s: the loop's steps_per_second, the window of its other rates

    def after_evaluation(self, step: int, metrics: dict[str, Any], elapsed: float) -> None:
        """Write the evaluation's summaries at ``step`` and log one line of its scalars."""
        self.eval.write_summaries(step, metrics)
        self.eval.flush()
        logger.info("eval at step %d (%.1fs): %s", step, elapsed, format_logs(metrics))

    def recorded(self, step: int) -> dict[str, Any]:
        """The eval metrics recorded at ``step`` (``{}`` without them)."""
        return self.eval.recorded(step)
