"""What a trial's model dir says about the trial (read by the sweep, ``cadence ls`` and ``cadence
report``), and the sweep's own record of each trial, ``trial-<n>/trial.json``.

A trial finished when its ``checkpoints/FINAL`` exists; it was pruned when ``pruned.json`` does
too. Its value is the best value of the metric over its evaluations (``eval/metrics.jsonl``, or
the sidecar's ``eval_<name>/``), as ``trainer.best_checkpoint`` would keep it.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence import layout

__all__ = ["TRIAL_LOG", "TRIAL_RECORD", "TrialRecord", "best_value", "eval_curve", "failure_line", "read_final",
           "trial_steps"]

TRIAL_LOG = "trial.log"
"""``trial-<n>/trial.log``: the trial processes' output (stdout and stderr), appended run after run."""
TRIAL_RECORD = "trial.json"
"""``trial-<n>/trial.json``: the sweep's record of the trial (its parameters, starts, outcome)."""

_FAILURE = re.compile(r"cadence: (?:failed|error): (.*)")


def read_final(trial_dir: Path) -> dict[str, Any] | None:
    """``checkpoints/FINAL`` (``step``, ``time`` and, for a run stopped early, ``reason``); None
    while the trial has not finished (or the file is unreadable)."""
    try:
        doc = json.loads((trial_dir / layout.CHECKPOINTS / "FINAL").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("step"), int) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def eval_curve(trial_dir: Path, metric: str, eval_name: str | None = None) -> list[tuple[int, float]]:
    """``(step, value)`` of ``metric`` in each evaluation of the trial, in step order (the last
    record of a step wins); non-numbers skipped, NaN and inf kept."""
    from cadence.summaries.metrics_file import read_metrics

    by_step: dict[int, float] = {}
    for record in read_metrics(layout.eval_dir(str(trial_dir), eval_name)):
        step, value = record.get("step"), _number(record.get(metric))
        if isinstance(step, int) and value is not None:
            by_step[step] = value
    return sorted(by_step.items())


def best_value(trial_dir: Path, metric: str, direction: str, eval_name: str | None = None) -> tuple[float, int] | None:
    """``(value, step)`` of the trial's best finite evaluation of ``metric`` (the earliest of
    equal ones); None when no evaluation recorded a finite value."""
    best: tuple[float, int] | None = None
    for step, value in eval_curve(trial_dir, metric, eval_name):
        if not math.isfinite(value):
            continue
        if best is None or (value > best[0] if direction == "maximize" else value < best[0]):
            best = (value, step)
    return best


def trial_steps(trial_dir: Path) -> int | None:
    """The step the trial's training reached: its FINAL step, else its newest committed checkpoint's;
    None before its first checkpoint."""
    final = read_final(trial_dir)
    if final is not None:
        return int(final["step"])
    from cadence.checkpoint import CheckpointManager

    if not (trial_dir / layout.CHECKPOINTS).is_dir():
        return None
    return CheckpointManager(layout.checkpoints_dir(str(trial_dir)), writer=False).latest_step()


def failure_line(log: Path, offset: int = 0) -> str:
    """Why a trial process failed, from its log after byte ``offset``: its last ``cadence: failed:``
    or ``cadence: error:`` line, else the last non-empty line (a traceback's exception)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        found = _FAILURE.search(line)
        if found:
            return found.group(1)
    return lines[-1] if lines else "(no output)"


@dataclass
class TrialRecord:
    """``trial.json``: the sweep's own record of a trial. ``state``: ``running``, ``complete``,
    ``pruned`` or ``failed``; ``starts``: every process start (time, pid), a resume adds one."""

    number: int
    params: dict[str, Any]
    state: str = "running"
    starts: list[dict[str, Any]] = field(default_factory=list)
    value: float | None = None
    best_step: int | None = None
    final_step: int | None = None
    reason: str | None = None  # why it was pruned or stopped early
    error: str | None = None  # why it failed
    ended: float | None = None

    @classmethod
    def read(cls, trial_dir: Path) -> TrialRecord | None:
        try:
            doc = json.loads((trial_dir / TRIAL_RECORD).read_text())
            return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})
        except (OSError, ValueError, TypeError):
            return None

    def write(self, trial_dir: Path) -> None:
        """Atomically (temp file + rename)."""
        trial_dir.mkdir(parents=True, exist_ok=True)
        temp = trial_dir / f".{TRIAL_RECORD}.tmp-{uuid.uuid4().hex[:8]}"
        temp.write_text(json.dumps(self.__dict__, indent=1) + "\n")
        os.replace(temp, trial_dir / TRIAL_RECORD)

    def started(self, pid: int) -> None:
        self.starts.append({"time": time.time(), "pid": pid})
