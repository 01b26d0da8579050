"""Backfills: evaluate the committed checkpoints of a run that have no record yet under an
evaluation's name, oldest first, then stop (``cadence evaluate --all`` / ``--steps``; OLMo-core's
``Trainer.eval_checkpoints``).

:class:`Backfill` is the sidecar's loop (:class:`~cadence.sidecar.continuous.ContinuousEvaluation`:
its restore, retries, records, best and lease updates) over a fixed list of steps instead of a
watcher: the steps committed when it starts, or the ones given, minus those ``evaluations.jsonl``
already records. It writes the same records to the same log as the sidecar of its name, so each
skips what the other did, and a backfill run again after a kill does only what is left. It never
waits for ``FINAL``: it runs on a finished run and while the trainer runs.

Leases: it holds its name's lease (the sidecar's holder), protecting only the checkpoint it reads
(``reading``, no range: retention goes on with the others). A listed checkpoint that retention
deleted before it could be read is recorded ``skipped`` with the reason; none is left unrecorded.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.errors import NoCheckpointError
from cadence.sidecar.continuous import ContinuousEvaluation, EvaluationRun, SidecarResult

logger = logging.getLogger("cadence.sidecar.evaluator")

__all__ = ["BACKFILLED", "Backfill", "backfill_plan"]

BACKFILLED = "backfilled"
"""A backfill's stop reason once its list is done."""


def backfill_plan(manager: CheckpointManager, records: list[dict[str, Any]],
                  checkpoints: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """``(todo, recorded)``: the selected steps without a record in ``records``, ascending, and
    those with one. ``checkpoints``: the steps to select (any order, repeats ignored); None: every
    step committed in ``manager`` now.

    Raises:
      NoCheckpointError: ``checkpoints`` names a step that is neither committed nor recorded, or
        (None) nothing is committed.
    """
    committed = set(manager.steps())
    done = {r["step"] for r in records}
    if checkpoints is None:
        if not committed:
            raise NoCheckpointError(f"no committed checkpoint in {manager.directory}: nothing to backfill")
        selected = sorted(committed)
    else:
        selected = sorted(set(checkpoints))
        missing = [s for s in selected if s not in committed and s not in done]
        if missing:
            raise NoCheckpointError(f"no committed checkpoint at step {', '.join(map(str, missing))} in "
                                    f"{manager.directory} (committed: {_steps(sorted(committed))})")
    return [s for s in selected if s not in done], [s for s in selected if s in done]


def _steps(steps: list[int]) -> str:
    """``steps`` for a message: all of them, or the first and last few."""
    if not steps:
        return "none"
    shown = steps if len(steps) <= 8 else [*steps[:3], "...", *steps[-3:]]
    return ", ".join(map(str, shown))


_WATCH_OPTIONS = {"mode", "poll_interval", "timeout", "timeout_fn", "max_evaluations", "train_steps", "max_pending"}
""":class:`ContinuousEvaluation`'s keywords of a watch for new checkpoints: none applies to a backfill."""


class Backfill(ContinuousEvaluation):
    """Evaluates a fixed list of ``controller``'s committed checkpoints that ``log`` holds no record
    of, oldest first; :meth:`run` returns a :class:`SidecarResult`.

    Args:
      controller: as :class:`ContinuousEvaluation`'s (each checkpoint restored, then evaluated).
      checkpoints: the steps to evaluate; None: every step committed when :meth:`run` starts.
      keeper: a started lease keeper without a range (``after=None``): each checkpoint is protected
        while it is read, then released (``None``: no lease).
      options: :class:`ContinuousEvaluation`'s keywords that apply to each checkpoint's evaluation
        and its record (``steps``, ``max_retries``, ``retry_backoff``, ``log``, ``best``,
        ``should_stop``, ``name``, ...); not those of a watch (``mode``, ``timeout``,
        ``max_evaluations``, ``max_pending``, ...), which do not apply.

    Stop reasons: ``"backfilled"`` (the list is done) or ``"stopped"`` (``should_stop``, checked
    between checkpoints). :meth:`run` raises :class:`~cadence.errors.NoCheckpointError` as
    :func:`backfill_plan` does, before anything is evaluated or written.
    """

    def __init__(
        self,
        controller: EvaluationRun,
        checkpoints: Sequence[int] | None = None,
        *,
        keeper: LeaseKeeper | None = None,
        **options: Any,
    ) -> None:
        watching = sorted(set(options) & _WATCH_OPTIONS)
        if watching:
            raise ValueError(f"a backfill watches nothing: {', '.join(watching)} do not apply")
        super().__init__(controller, keeper=keeper, **{"name": "backfill", **options})
        self.checkpoints = None if checkpoints is None else list(checkpoints)

    def run(self) -> SidecarResult:
        """Evaluate (or record as skipped or failed) each step of the plan, oldest first."""
        records = self.log.records() if self.log is not None else []
        todo, recorded = backfill_plan(self.manager, records, self.checkpoints)
        result = SidecarResult(stop_reason="", message="", best=self._best_of(records))
        if recorded and self.log is not None:
            logger.info("%s: %d of the selected checkpoints already have a record in %s: %d left", self.name,
                        len(recorded), self.log.path, len(todo))
        for i, step in enumerate(todo):
            if self.should_stop is not None and self.should_stop():
                return self._finish(result, "stopped", f"stopped on request with {len(todo) - i} of {len(todo)} "
                                    "checkpoints left (run the backfill again to evaluate them)")
            self._keep(reading=step)
            record = self._evaluate(step)
            self._record(record)
            self._keep(reading=None)
            self._tally(result, record)
        if not todo:
            return self._finish(result, BACKFILLED, "nothing to backfill: each selected checkpoint has a record")
        return self._finish(result, BACKFILLED, f"backfilled {len(todo)} checkpoints (steps {_steps(todo)})")
