"""``cadence ls SWEEP_DIR``: the trials of a sweep -- number, state, best value of the metric and its
step, the steps trained, the parameters, and why a trial was pruned or failed -- as data
(:func:`sweep_listing`, what ``--json`` prints) and as a table (:func:`format_sweep_table`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from cadence.summaries.progress import format_value

__all__ = ["format_sweep_table", "short_names", "sweep_listing"]

_GAP = "  "


def sweep_listing(path: str) -> dict[str, Any]:
    """The sweep in ``path`` as JSON-able data::

        {"sweep_dir", "study_name", "metric", "direction", "evaluation", "best_link" (its target or null),
         "counts": {state: n}, "best": {"number", "value", "params"} | null,
         "trials": [{"number", "state" (complete | pruned | fail | running | waiting), "params", "value" (the
                     study's), "best_value" / "best_step" (the best evaluation so far, also of an unfinished or
                     pruned trial), "steps" (trained: FINAL's step, else the newest checkpoint's), "starts"
                     (process starts: a resume adds one), "pruned" / "stopped" / "error" (reasons), "dir",
                     "best" (the study's best trial)}]}

    Raises ConfigError: not a sweep dir, optuna missing, no study.
    """
    from cadence.sweep.study import load_sweep
    from cadence.sweep.trials import TrialRecord, best_value, trial_steps

    sweep_dir, record, study = load_sweep(path)
    eval_name = _eval_name(record.config) if record.evaluation == "sidecar" else None
    try:
        best_trial = study.best_trial
        best = {"number": best_trial.number, "value": best_trial.value, "params": best_trial.params}
    except ValueError:
        best = None
    rows = []
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        state = t.state.name.lower()
        counts[state] = counts.get(state, 0) + 1
        trial_dir = sweep_dir.trial_dir(t.number)
        found = best_value(trial_dir, record.metric, record.direction, eval_name) if trial_dir.is_dir() else None
        own = TrialRecord.read(trial_dir)
        rows.append({
            "number": t.number, "state": state, "params": dict(t.params), "value": t.value,
            "best_value": found[0] if found else None, "best_step": found[1] if found else None,
            "steps": trial_steps(trial_dir) if trial_dir.is_dir() else None,
            "starts": len(own.starts) if own is not None else 0,
            "pruned": t.user_attrs.get("pruned"), "stopped": t.user_attrs.get("stopped"),
            "error": t.user_attrs.get("error"), "dir": str(trial_dir),
            "best": best is not None and best["number"] == t.number,
        })
    link = sweep_dir.best_link
    return {
        "sweep_dir": str(sweep_dir.root), "study_name": record.study_name, "metric": record.metric,
        "direction": record.direction, "evaluation": record.evaluation,
        "best_link": os.readlink(link) if link.is_symlink() else None,
        "counts": counts, "best": best, "trials": rows,
    }


def _eval_name(config: Mapping[str, Any]) -> str | None:
    sidecar = config.get("sidecar")
    return sidecar.get("name") if isinstance(sidecar, Mapping) else None


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest unambiguous dotted suffix (``task.params.lr`` -> ``lr``)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if sum(k == suffix or k.endswith("." + suffix) for k in keys) == 1:
                out[key] = suffix
                break
        else:
            out[key] = key
    return out


def _note(row: Mapping[str, Any]) -> str:
    notes = ["BEST"] if row["best"] else []
    if row["state"] == "pruned":
        notes.append("pruned (see below)")
    elif row["state"] == "fail":
        notes.append("failed (see below)")
    elif row["stopped"]:
        notes.append("stopped early (see below)")
    if row["starts"] > 1:
        notes.append(f"resumed x{row['starts'] - 1}")
    return ", ".join(notes)


def format_sweep_table(listing: Mapping[str, Any], width: int = 100) -> str:
    """The listing as a text table (parameters that do not fit in ``width`` columns are left out,
    the last first; a line names them), then the reasons of pruned, stopped and failed trials and
    the best trial."""
    rows = listing["trials"]
    if not rows:
        return f"no trials yet in {listing['sweep_dir']}"
    keys = list(dict.fromkeys(k for row in rows for k in row["params"]))
    names = short_names(keys)
    metric = listing["metric"]

    def table(shown: list[str]) -> list[str]:
        header = ["trial", "state", f"best {metric}", "at step", "steps", *(names[k] for k in shown), ""]
        cells = [[str(r["number"]), r["state"], format_value(r["best_value"]) if r["best_value"] is not None else "",
                  "" if r["best_step"] is None else str(r["best_step"]), "" if r["steps"] is None else str(r["steps"]),
                  *(format_value(r["params"][k]) if k in r["params"] else "" for k in shown), _note(r)] for r in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        right = [True, False, True, True, True, *([True] * len(shown)), False]

        def line(values: list[str]) -> str:
            return _GAP.join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

        return [line(header), line(["-" * w for w in widths]), *(line(c) for c in cells)]

    shown = list(keys)
    lines = table(shown)
    while shown and max(len(line) for line in lines) > width:
        shown.pop()
        lines = table(shown)
    direction = "higher" if listing["direction"] == "maximize" else "lower"
    out = [f"sweep {listing['sweep_dir']} (study {listing['study_name']}; {metric}: {direction} is better)", *lines]
    left_out = [k for k in keys if k not in shown]
    if left_out:
        out.append(f"(not shown in {width} columns: {', '.join(left_out)}; cadence ls --json has every parameter)")
    for r in rows:
        for label, key in (("pruned", "pruned"), ("stopped early", "stopped"), ("failed", "error")):
            if r[key]:
                out.append(f"trial {r['number']}: {label}: {r[key]}")
    best = listing["best"]
    if best is not None:
        params = "  ".join(f"{k}={format_value(v)}" for k, v in best["params"].items())
        link = f"; best -> {listing['best_link']}" if listing["best_link"] else ""
        out.append(f"best: trial {best['number']}: {metric}={format_value(best['value'])}  {params}{link}")
    return "\n".join(out)
