"""``cadence ls``: a model dir's committed checkpoints, with their eval metrics and marks (best,
final, latest, verified), as data (:func:`list_checkpoints`, what ``--json`` prints) and as a
table that fits the terminal (:func:`format_table`).
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping

from cadence import layout
from cadence.summaries.progress import format_value
from cadence.units import format_size

__all__ = ["list_checkpoints", "format_table"]

_GAP = "  "
_TIME_FORMAT = "%Y-%m-%d %H:%M"


def _read_best(model_dir: str) -> dict[str, Any] | None:
    """``best/best.json`` (the best checkpoint's record), or None when there is none (or it is unreadable)."""
    from cadence.actions.best_checkpoint import read_best_record

    try:
        record = read_best_record(layout.best_dir(model_dir))
    except ValueError:
        return None
    if record is None:
        return None
    out = {k: record.get(k) for k in ("step", "metric", "value", "higher_is_better")}
    out["path"] = layout.join(layout.best_dir(model_dir), f"ckpt-{record['step']}")
    return out


def list_checkpoints(model_dir: str, *, verify: bool = False) -> dict[str, Any]:
    """The committed checkpoints of ``model_dir`` as JSON-able data::

        {"model_dir", "checkpoints_dir", "latest_step", "final_step", "corrupt": <count>,
         "best": {"step", "metric", "value", "higher_is_better", "path"} | null,
         "checkpoints": [{"step", "time" (POSIX seconds), "committed" (ISO 8601, UTC), "size"
                          (bytes), "files", "ranks" (how many ranks wrote its files: more than one
                          for a sharded checkpoint), "path", "best", "final", "latest", "metrics"
                          (the eval metrics recorded at that step, in eval/), "verified", "corrupt"}],
         "moved_aside": [paths of checkpoints that did not verify and were moved aside]}

    ``verify``: read every checkpoint's files against its manifest (``verified`` true or false;
    null without it). ``corrupt``: the reason, for a checkpoint whose manifest cannot be read or
    (with ``verify``) whose files do not match it. Raises ModelDirError when ``model_dir`` is missing
    or not a cadence model dir (:func:`~cadence.layout.require_cadence_model_dir`).
    """
    from cadence.checkpoint import CheckpointManager
    from cadence.errors import CorruptCheckpointError
    from cadence.storage import Storage
    from cadence.summaries.metrics_file import read_metrics

    layout.require_cadence_model_dir(model_dir)
    checkpoints_dir = layout.checkpoints_dir(model_dir)
    manager = CheckpointManager(checkpoints_dir, writer=False)
    steps = manager.steps()
    evals: dict[int, dict[str, Any]] = {}
    eval_dir = layout.eval_dir(model_dir)
    if steps and Storage(eval_dir).exists(eval_dir):
        for record in read_metrics(eval_dir):
            evals[int(record["step"])] = {k: v for k, v in record.items() if k not in ("step", "time")}
    final = manager.final_step() if steps else None
    best = _read_best(model_dir)
    rows: list[dict[str, Any]] = []
    for step in steps:
        row: dict[str, Any] = {
            "step": step, "time": None, "committed": None, "size": None, "files": None, "ranks": None,
            "path": manager.path(step), "best": best is not None and best["step"] == step,
            "final": step == final, "latest": step == steps[-1], "metrics": evals.get(step, {}),
            "verified": None, "corrupt": None,
        }
        try:
            info = manager.info(step)
        except CorruptCheckpointError as e:  # its manifest cannot be read (invalid, or a symbolic link)
            row.update(corrupt=e.reason, verified=False if verify else None)
            rows.append(row)
            continue
        when = datetime.datetime.fromtimestamp(info["time"], datetime.timezone.utc)
        row.update(time=info["time"], committed=when.isoformat(timespec="seconds"), size=info["size"],
                   files=info["files"], ranks=info["ranks"])
        if verify:
            try:
                manager.read(step)
                row["verified"] = True
            except CorruptCheckpointError as e:
                row.update(verified=False, corrupt=e.reason)
        rows.append(row)
    return {
        "model_dir": model_dir,
        "checkpoints_dir": checkpoints_dir,
        "latest_step": steps[-1] if steps else None,
        "final_step": final,
        "best": best,
        "corrupt": sum(row["corrupt"] is not None for row in rows),
        "checkpoints": rows,
        "moved_aside": [layout.join(checkpoints_dir, name) for name in manager.quarantined()],
    }


def _metric_order(listing: Mapping[str, Any]) -> list[str]:
    """The metric columns, most wanted first: the best checkpoint's metric, ``loss``, then by name."""
    names = sorted({k for row in listing["checkpoints"] for k in row["metrics"]})
    first = [m for m in ((listing["best"] or {}).get("metric"), "loss") if m in names]
    return list(dict.fromkeys([*first, *names]))


def _notes(row: Mapping[str, Any]) -> str:
    marks = [name for name in ("best", "final", "latest") if row[name]]
    if (row.get("ranks") or 1) > 1:
        marks.append(f"sharded ({row['ranks']} ranks)")
    if row["verified"]:
        marks.append("verified")
    if row["corrupt"] is not None:
        marks.append("CORRUPT (see below)")
    return ", ".join(marks)


def _render(header: list[str], cells: list[list[str]], right: list[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]

    def line(values: list[str]) -> str:
        return _GAP.join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in cells)]


def format_table(listing: Mapping[str, Any], width: int = 80) -> str:
    """The listing as text at most ``width`` columns wide: step, commit time, size, the eval
    metrics that fit (the best checkpoint's metric and ``loss`` first; a line names those left
    out), and the marks (best, final, latest, sharded (N ranks), verified, CORRUPT); below it the
    reasons of corrupt checkpoints, the best checkpoint and what was moved aside."""
    rows = listing["checkpoints"]
    if not rows:
        return f"no committed checkpoints in {listing['checkpoints_dir']}"
    metrics = _metric_order(listing)

    def table(shown: list[str]) -> list[str]:
        header = ["step", "committed", "size", *shown, ""]
        cells = []
        for row in rows:
            when = (datetime.datetime.fromtimestamp(row["time"]).strftime(_TIME_FORMAT)
                    if row["time"] is not None else "?")
            size = format_size(row["size"]) if row["size"] is not None else "?"
            values = [format_value(row["metrics"][m]) if m in row["metrics"] else "" for m in shown]
            cells.append([str(row["step"]), when, size, *values, _notes(row)])
        return _render(header, cells, [True, False, True, *([True] * len(shown)), False])

    shown = list(metrics)
    lines = table(shown)
    while shown and max(len(line) for line in lines) > width:
        shown.pop()
        lines = table(shown)
    out = [f"checkpoints in {listing['checkpoints_dir']}", *lines]
    left_out = [m for m in metrics if m not in shown]
    if left_out:
        out.append(f"(not shown in {width} columns: {', '.join(left_out)}; cadence ls --json has every metric)")
    for row in rows:
        if row["corrupt"] is not None:
            out.append(f"step {row['step']}: CORRUPT: {row['corrupt']}")
    best = listing["best"]
    if best is not None:
        value = f" ({best['metric']}={format_value(best['value'])})" if best.get("metric") else ""
        kept = "" if any(row["step"] == best["step"] for row in rows) else " (no longer in checkpoints/)"
        out.append(f"best: step {best['step']}{value}: {best['path']}{kept}")
    out += [f"moved aside (did not verify): {path}" for path in listing["moved_aside"]]
    return "\n".join(out)
