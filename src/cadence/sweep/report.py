"""``cadence report SWEEP_DIR``: one self-contained HTML page (and a PNG) about a sweep.

* ``SWEEP_DIR/report.png``: every trial's curve of the metric against the global step (complete
  trials solid, pruned dashed and ending in an ``x``, failed dotted, the best trial thick), beside
  Optuna's parameter importances (``optuna.importance.get_param_importances``: it needs two complete
  trials at least; until then the panel and the page say so);
* ``SWEEP_DIR/report.html``: the facts (study, metric, trials by state, the best trial and where
  ``best`` points), the figure (embedded), the trials' table (as ``cadence ls`` lists them, with
  the reasons), the importances and the space. Inline CSS, no external resource, every value escaped.

Reads the sweep (the study and the trial dirs); the two files are its only writes, and they replace
only a report cadence wrote (:mod:`cadence.reports.outputs`). Needs
matplotlib (``pip install 'cadence[report]'``) and optuna.
"""

from __future__ import annotations

import base64
import io
import json
import math
import time
from pathlib import Path
from typing import Any

from cadence.errors import CadenceError, ConfigError
from cadence.reports.run_report import INSTALL_HINT, ReportPaths
from cadence.reports.page import PAGE_CSS as _CSS
from cadence.reports.page import escape as _e
from cadence.reports.page import format_time as _when
from cadence.reports.page import html_table as _table
from cadence.reports.outputs import HTML_GENERATOR, PNG_METADATA, check_report_targets, write_report
from cadence.sweep.listing import short_names, sweep_listing

__all__ = ["IMPORTANCE_NEEDS", "build_sweep_report"]

IMPORTANCE_NEEDS = 2
"""Complete trials Optuna's parameter importances need."""

_STATE_STYLE = {"complete": "-", "pruned": "--", "fail": ":", "running": "-", "waiting": "-"}
_BEST_COLOR = "#2ca02c"


def _importances(study: Any, complete: int) -> tuple[dict[str, float], str | None]:
    """``(importance by parameter, None)``, or ``({}, why not)``."""
    if complete < IMPORTANCE_NEEDS:
        return {}, (f"parameter importance needs {IMPORTANCE_NEEDS} complete trials at least; "
                    f"this sweep has {complete}")
    from cadence.sweep._optuna import require_optuna

    optuna = require_optuna("cadence report")
    try:
        return dict(optuna.importance.get_param_importances(study)), None
    except Exception as e:  # noqa: BLE001 - a report shows what it can: e.g. every trial with one value
        return {}, f"Optuna could not compute parameter importances: {e}"


def _figure(listing: dict[str, Any], curves: dict[int, list[tuple[int, float]]],
            importances: dict[str, float], why_not: str | None) -> bytes:
    try:
        import matplotlib  # noqa: F401  (first: a missing package is named as such)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CadenceError(f"cadence report needs matplotlib ({e}); install it: {INSTALL_HINT}") from None
    fig = Figure(figsize=(12.4, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_curves, ax_imp = fig.subplots(1, 2, width_ratios=[3, 2])
    metric = listing["metric"]
    palette = [matplotlib.colormaps["tab10"](i) for i in range(10) if i != 2]  # green is the best trial's
    drawn = 0
    for row in listing["trials"]:
        points = curves.get(row["number"], [])
        if not points:
            continue
        steps = [s for s, _ in points]
        values = [v if math.isfinite(v) else math.nan for _, v in points]
        color = _BEST_COLOR if row["best"] else palette[row["number"] % len(palette)]
        ax_curves.plot(steps, values, linestyle=_STATE_STYLE.get(row["state"], "-"), color=color,
                       linewidth=3.0 if row["best"] else 1.3, marker="o" if len(points) < 30 else None, markersize=3,
                       label=f"trial {row['number']} ({row['state']}{', best' if row['best'] else ''})")
        if row["state"] == "pruned":
            ax_curves.plot(steps[-1:], values[-1:], marker="x", markersize=9, color=color, linestyle="none")
        drawn += 1
    if drawn:
        ax_curves.legend(fontsize=7, loc="best", ncol=2 if drawn > 8 else 1)
    else:
        ax_curves.text(0.5, 0.5, "no evaluations recorded yet", ha="center", va="center", transform=ax_curves.transAxes)
    ax_curves.set_title(f"eval {metric} per trial", fontsize=10, loc="left")
    ax_curves.set_xlabel("step", fontsize=8)
    ax_curves.grid(True, alpha=0.3)
    ax_curves.tick_params(labelsize=8)
    if importances:
        names = short_names(list(importances))
        order = sorted(importances, key=importances.__getitem__)
        ax_imp.barh([names[k] for k in order], [importances[k] for k in order], color="#1f77b4")
        ax_imp.set_xlabel("importance (Optuna, normalized)", fontsize=8)
        ax_imp.tick_params(labelsize=8)
    else:
        ax_imp.text(0.5, 0.5, why_not or "", ha="center", va="center", wrap=True, transform=ax_imp.transAxes,
                    fontsize=9, color="0.35")
        ax_imp.set_axis_off()
    ax_imp.set_title("parameter importance", fontsize=10, loc="left")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata=PNG_METADATA)
    return buffer.getvalue()


def _trial_rows(listing: dict[str, Any]) -> list[list[Any]]:
    keys = list(dict.fromkeys(k for row in listing["trials"] for k in row["params"]))
    rows = []
    for r in listing["trials"]:
        why = r["pruned"] or r["error"] or r["stopped"] or ""
        rows.append([r["number"], r["state"] + (" (best)" if r["best"] else ""), r["best_value"], r["best_step"],
                     r["steps"], *(r["params"].get(k, "") for k in keys), why])
    return rows


def _page(listing: dict[str, Any], png: bytes, importances: dict[str, float], why_not: str | None,
          space: dict[str, Any]) -> str:
    keys = list(dict.fromkeys(k for row in listing["trials"] for k in row["params"]))
    best = listing["best"]
    counts = ", ".join(f"{n} {state}" for state, n in sorted(listing["counts"].items())) or "none"
    facts = [("sweep dir", listing["sweep_dir"]), ("study", f"{listing['study_name']} (study.db)"),
             ("objective", f"{listing['direction']} {listing['metric']} (the best evaluation of each trial)"),
             ("evaluated", listing["evaluation"]), ("trials", counts)]
    if best is not None:
        params = "  ".join(f"{k}={v}" for k, v in best["params"].items())
        facts.append(("best trial", f"trial {best['number']}: {listing['metric']} = {best['value']:.6g}  {params}"))
        facts.append(("best ->", listing["best_link"] or "(no link)"))
    else:
        facts.append(("best trial", "none complete yet"))
    facts.append(("report generated", _when(time.time())))
    parts = [
        "<!DOCTYPE html>", f'<html lang="en"><head><meta charset="utf-8">{HTML_GENERATOR}',
        f"<title>cadence sweep report: {_e(listing['sweep_dir'])}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        "<h1>cadence sweep report</h1>", f'<p class="sub">{_e(listing["sweep_dir"])}</p>',
        '<table class="facts"><tbody>' + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
        + "</tbody></table>",
        "<h2>Trials</h2>",
        f'<img class="plots" alt="the trials\' curves and the parameter importances" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">',
        _table(["trial", "state", f"best {listing['metric']}", "at step", "steps", *keys, "pruned / failed / stopped"],
               _trial_rows(listing)),
        "<h2>Parameter importance</h2>",
    ]
    if importances:
        parts.append(_table(["parameter", "importance"], [[k, v] for k, v in sorted(importances.items(),
                                                                                 key=lambda kv: -kv[1])]))
    else:
        parts.append(f'<p class="empty">{_e(why_not)}</p>')
    parts += ["<h2>Search space</h2>", f"<pre>{_e(json.dumps(space, indent=1))}</pre>", "</main></body></html>\n"]
    return "\n".join(parts)


def build_sweep_report(path: str, out: str | None = None) -> ReportPaths:
    """Write the sweep's HTML report and its PNG; return their paths. ``out``: the HTML page's path
    (default ``SWEEP_DIR/report.html``); the PNG goes next to it with the same stem.

    Raises:
      ConfigError: not a sweep dir; ``out`` ends with ``.png``; optuna missing; the page's or the
        PNG's path holds anything but a report cadence wrote (checked before the report is built).
      CadenceError: matplotlib missing (the message says how to install it).
    """
    from cadence.sweep.study import load_sweep
    from cadence.sweep.trials import eval_curve

    listing = sweep_listing(path)
    sweep_dir, record, study = load_sweep(path)
    html_path = Path(out) if out is not None else sweep_dir.root / "report.html"
    if html_path.suffix.lower() == ".png":
        raise ConfigError(f"--out: the HTML page's path, not a .png (the PNG goes next to it): {out}")
    png_path, label = html_path.with_suffix(".png"), "--out" if out is not None else "report"
    check_report_targets(str(html_path), str(png_path), label)
    eval_name = None
    if record.evaluation == "sidecar":
        eval_name = (record.config.get("sidecar") or {}).get("name")
    curves = {r["number"]: eval_curve(Path(r["dir"]), record.metric, eval_name) for r in listing["trials"]}
    importances, why_not = _importances(study, listing["counts"].get("complete", 0))
    png = _figure(listing, curves, importances, why_not)
    page = _page(listing, png, importances, why_not, record.space)
    html, png_url = write_report(str(html_path), page.encode("utf-8"), str(png_path), png, label)
    return ReportPaths(html=html, png=png_url)
