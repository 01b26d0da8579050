"""``cadence report``: one self-contained HTML page (and a PNG) describing a run's model dir.

:func:`build_report` reads a model directory (docs/design.md's contract) and writes

* ``report.html``: run facts (finished or not, steps, duration, steps/s, the medians of the
  throughput -- samples/s, tokens/s, MFU, peak memory -- when logged, best), the metric plots
  (embedded as a base64 PNG), a table of every metric series, for a run of replica groups their
  steps with fewer groups, steps run again and samples skipped / seen twice
  (:mod:`cadence.reports.replica_groups`), the sidecar's evaluations
  (``evaluations.jsonl``), the checkpoint timeline and the resolved ``config.yaml``. Inline CSS,
  no external resource (no ``src=``/``href=`` pointing anywhere), every value HTML-escaped;
* ``report.png`` next to it (same stem): the figure with all the plots, one subplot per metric
  on a shared step axis (``train/*`` scalars, the loss and the throughput first; each eval metric
  with one series per eval dir, ``eval/`` and ``eval_<name>/``; the best checkpoint's step as a
  dashed vertical line).

It only reads the model dir (checkpoints through a read-only ``CheckpointManager``); the two
files are the only writes. Needs matplotlib (``pip install 'cadence[report]'``), imported when a
report is built, with the Agg canvas (no display, no global pyplot state). No torch.
"""

from __future__ import annotations

import base64
import datetime
import io
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cadence import layout
from cadence.errors import CadenceError
from cadence.units import format_size
from cadence.reports.page import PAGE_CSS as _CSS
from cadence.reports.page import escape as _e
from cadence.reports.page import format_cell as _fmt
from cadence.reports.page import format_time as _when
from cadence.reports.page import html_table as _table
from cadence.reports.replica_groups import ReplicaGroups, read_replica_groups, replica_groups_of, replica_section
from cadence.reports.outputs import HTML_GENERATOR, PNG_METADATA, check_report_targets, report_paths, write_report
from cadence.storage import Storage
from cadence.summaries.metrics_file import METRICS_FILE, read_metrics
from cadence.summaries.throughput import (MFU, MODEL_TFLOPS_PER_SECOND, PEAK_ALLOCATED_GIB, PEAK_RESERVED_GIB,
                                SAMPLES_PER_SECOND, TOKENS_PER_SECOND)

__all__ = ["ReportPaths", "build_report"]

INSTALL_HINT = "pip install 'cadence[report]'"

_RESERVED = ("step", "time")
_TRAIN_COLOR = "#1f77b4"  # the training series (the browser test looks for this colour)
_EVAL_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_BEST_COLOR = "#2ca02c"
_BAD_COLOR = "#d62728"
_THROUGHPUT = {  # train series shown after the loss, and their medians among the facts: (label, scale, unit)
    SAMPLES_PER_SECOND: ("samples/s", 1.0, ""), TOKENS_PER_SECOND: ("tokens/s", 1.0, ""),
    MODEL_TFLOPS_PER_SECOND: ("model TFLOP/s per device", 1.0, ""), MFU: ("MFU", 100.0, "%"),
    PEAK_ALLOCATED_GIB: ("peak memory allocated", 1.0, " GiB"), PEAK_RESERVED_GIB: ("peak memory reserved", 1.0, " GiB"),
}


@dataclass(frozen=True)
class ReportPaths:
    """Where :func:`build_report` wrote the report: local paths, or fsspec URLs."""

    html: str
    png: str


# --------------------------------------------------------------------------------------------
# what is read from the model dir


@dataclass
class _Series:
    source: str  # "train", "eval", "eval_holdout", ...
    metric: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class _Run:
    model_dir: str
    series: list[_Series] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # every recorded wall time
    steps_per_second: list[float] = field(default_factory=list)
    throughput: dict[str, list[float]] = field(default_factory=dict)  # train samples_per_second, ..., mfu, memory
    last_train_step: int | None = None
    evaluations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # eval dir -> records
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    final_step: int | None = None
    best: dict[str, Any] | None = None
    config_text: str | None = None
    train_steps: int | None = None
    notes: list[str] = field(default_factory=list)  # things that could not be read
    replica_groups: ReplicaGroups | None = None  # a run of fault-tolerant replica groups: their counts


def _number(value: Any) -> float | None:
    """A metric value as a float (NaN/inf kept, also from their JSON string forms); None when it
    is not a scalar number (strings, lists, mappings)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def _series_of(source: str, records: Iterable[Mapping[str, Any]]) -> list[_Series]:
    by_name: dict[str, _Series] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, raw in record.items():
            if key in _RESERVED:
                continue
            value = _number(raw)
            if value is None:
                continue
            series = by_name.setdefault(str(key), _Series(source, str(key)))
            series.steps.append(step)
            series.values.append(value)
    return list(by_name.values())


def _times(records: Iterable[Mapping[str, Any]]) -> list[float]:
    return [float(r["time"]) for r in records
            if isinstance(r.get("time"), (int, float)) and math.isfinite(r["time"])]


def _read_text(storage: Storage, path: str) -> str | None:
    try:
        return storage.read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _check_model_dir(model_dir: str) -> Storage:
    layout.require_cadence_model_dir(model_dir)
    return Storage(model_dir)


def _read_run(model_dir: str, storage: Storage) -> _Run:
    run = _Run(model_dir=storage.url(storage.root))

    run.config_text = _read_text(storage, storage.join(layout.CONFIG))
    if run.config_text is not None:
        run.train_steps = _train_steps(run.config_text)

    train = read_metrics(layout.train_dir(model_dir))
    run.series += _series_of(layout.TRAIN, train)
    run.times += _times(train)
    run.steps_per_second = [v for r in train if (v := _number(r.get("steps_per_second"))) is not None
                            and math.isfinite(v)]
    for key in _THROUGHPUT:
        values = [v for r in train if (v := _number(r.get(key))) is not None and math.isfinite(v)]
        if values:
            run.throughput[key] = values
    train_steps = [r["step"] for r in train if isinstance(r.get("step"), int)]
    run.last_train_step = max(train_steps) if train_steps else None
    run.replica_groups = read_replica_groups(model_dir, replica_groups_of(run.config_text))

    from cadence.sidecar.evaluator import EvaluationLog

    for name in storage.listdir(storage.root):
        if name != layout.EVAL and not name.startswith(layout.EVAL + "_"):
            continue
        directory = layout.join(model_dir, name)
        if not storage.isdir(storage.join(name)):
            continue
        records = read_metrics(layout.join(directory, METRICS_FILE))
        evaluations = EvaluationLog(directory).records()
        if evaluations:
            run.evaluations[name] = evaluations
            run.times += _times(evaluations)
        if not records:  # metrics.jsonl missing: the sidecar's records still hold the metrics
            records = [{**r["metrics"], "step": r["step"]} for r in evaluations
                       if r.get("status") == "evaluated" and isinstance(r.get("metrics"), Mapping)]
        run.series += _series_of(name, records)
        run.times += _times(records)

    _read_checkpoints(run, model_dir)
    run.best = _read_best(run, model_dir)
    return run


def _train_steps(config_text: str) -> int | None:
    import yaml

    try:
        document = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return None
    trainer = document.get("trainer") if isinstance(document, dict) else None
    steps = trainer.get("train_steps") if isinstance(trainer, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _read_checkpoints(run: _Run, model_dir: str) -> None:
    from cadence.checkpoint import CheckpointManager

    manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False)
    for step in manager.steps():
        try:
            run.checkpoints.append(manager.info(step))
        except CadenceError as e:
            run.notes.append(f"checkpoint {step}: {e}")
            run.checkpoints.append({"step": step, "time": None, "size": None, "files": None, "error": str(e)})
    run.times += [c["time"] for c in run.checkpoints if isinstance(c["time"], (int, float))]
    run.final_step = manager.final_step()


def _read_best(run: _Run, model_dir: str) -> dict[str, Any] | None:
    """best/best.json, else the record in the best checkpoint's state.json, else None."""
    from cadence.actions.best_checkpoint import BEST_JSON, RECORD, read_best_record
    from cadence.checkpoint import CheckpointManager

    best_dir = layout.best_dir(model_dir)
    try:
        record = read_best_record(best_dir)
        if record is not None:
            return record
    except ValueError as e:
        storage = Storage(best_dir)
        run.notes.append(f"{storage.url(storage.join(BEST_JSON))}: unreadable ({e})")
    manager = CheckpointManager(best_dir, writer=False)
    for step in reversed(manager.steps()):
        try:
            record = manager.read_state(step)["state"].get(RECORD)
        except CadenceError as e:
            run.notes.append(f"best checkpoint {step}: {e}")
            continue
        return record if isinstance(record, dict) else {"step": step}
    return None


# --------------------------------------------------------------------------------------------
# the figure


def _canvas_figure(nplots: int) -> tuple[Any, Any]:
    """A matplotlib Figure on an Agg canvas with ``nplots`` axes (2 columns, shared step axis)."""
    try:
        import matplotlib  # noqa: F401  (first: a missing package is named as such)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CadenceError(f"cadence report needs matplotlib ({e}); install it: {INSTALL_HINT}") from None
    ncols = 1 if nplots <= 1 else 2
    nrows = max(1, math.ceil(nplots / ncols))
    fig = Figure(figsize=(6.2 * ncols, 2.9 * nrows + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    for ax in axes[nplots:]:
        ax.set_visible(False)
    return fig, axes


def _literal(text: str) -> str:
    """``text`` shown as is by matplotlib (a ``$`` would start mathtext)."""
    return text.replace("$", r"\$")


def _panel_order(panels: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The order of the figure's ``(kind, metric)`` subplots: train before eval; in train the loss,
    then the throughput (steps/s, samples/s, tokens/s, model TFLOP/s, MFU, memory), then the rest by
    name; in eval the loss, then the rest by name."""
    first = {name: i for i, name in enumerate(("loss", "steps_per_second", *_THROUGHPUT))}
    return sorted(panels, key=lambda k: (k[0] != "train", first.get(k[1], len(first)) if k[0] == "train"
                                         else int(k[1] != "loss"), k[1]))


def _plot(run: _Run) -> bytes:
    """The PNG of every metric against step."""
    groups: dict[tuple[str, str], list[_Series]] = {}
    for series in run.series:
        key = ("train" if series.source == layout.TRAIN else "eval", series.metric)
        groups.setdefault(key, []).append(series)
    fig, axes = _canvas_figure(max(1, len(groups)))
    from matplotlib.ticker import MaxNLocator

    if not groups:
        axes[0].text(0.5, 0.5, "no metrics recorded yet", ha="center", va="center", transform=axes[0].transAxes)
        axes[0].set_axis_off()
    sources = sorted({s.source for s in run.series if s.source != layout.TRAIN})
    colors = {source: _EVAL_COLORS[i % len(_EVAL_COLORS)] for i, source in enumerate(sources)}
    colors[layout.TRAIN] = _TRAIN_COLOR
    labels = {name: f"{name} (sidecar)" for name in run.evaluations}
    best_step = run.best.get("step") if run.best else None
    order = _panel_order(groups)
    for ax, (kind, metric) in zip(axes, order):
        members = groups[(kind, metric)]
        finite = False
        bad_steps: list[int] = []
        for series in members:
            values = [v if math.isfinite(v) else math.nan for v in series.values]  # NaN/inf: a gap
            finite = finite or any(math.isfinite(v) for v in values)
            bad_steps += [step for step, v in zip(series.steps, series.values) if not math.isfinite(v)]
            ax.plot(series.steps, values, color=colors[series.source], marker="o" if len(values) < 30 else None,
                    markersize=3, linewidth=1.6, label=_literal(labels.get(series.source, series.source)))
        if bad_steps:  # marked along the bottom edge: x in steps, y in axes coordinates
            ax.plot(bad_steps, [0.03] * len(bad_steps), linestyle="none", marker="x", color=_BAD_COLOR,
                    transform=ax.get_xaxis_transform(), label="NaN / inf")
        if kind == "eval" and isinstance(best_step, int):
            ax.axvline(best_step, color=_BEST_COLOR, linestyle="--", linewidth=1.2, label=f"best (step {best_step})")
        if not finite:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_title(_literal(f"{kind}: {metric}"), fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8, labelbottom=True)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if kind == "eval" or bad_steps:
            ax.legend(fontsize=7, loc="best")
    for ax in axes:
        if ax.get_visible() and groups:
            ax.set_xlabel("step", fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata=PNG_METADATA)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# the page


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _size(n: Any) -> str:
    return format_size(n) if isinstance(n, (int, float)) else ""


def _facts(run: _Run) -> list[tuple[str, str]]:
    facts = [("model dir", run.model_dir)]
    if run.final_step is not None:
        facts.append(("status", f"finished (FINAL at step {run.final_step})"))
    else:
        facts.append(("status", "not finished (no FINAL: still running, stopped or killed)"))
    steps = str(run.last_train_step) if run.last_train_step is not None else "none logged"
    if run.train_steps is not None:
        steps += f" of {run.train_steps} (trainer.train_steps)"
    facts.append(("last logged train step", steps))
    if run.checkpoints:
        facts.append(("latest checkpoint", str(run.checkpoints[-1]["step"])))
    if len(run.times) >= 2:
        start, end = min(run.times), max(run.times)
        span = f"{_when(start)} to {_when(end)}, first to last recorded time"
        facts.append(("duration", f"{_duration(end - start)}  ({span})"))
    if run.steps_per_second:
        median, last = statistics.median(run.steps_per_second), run.steps_per_second[-1]
        facts.append(("steps/s", f"median {median:.4g}, last {last:.4g} (train steps_per_second)"))
    for key, (label, scale, unit) in _THROUGHPUT.items():
        if values := run.throughput.get(key):
            median, last = statistics.median(values) * scale, values[-1] * scale
            facts.append((label, f"median {median:.4g}{unit}, last {last:.4g}{unit} (train {key})"))
    if run.best:
        value = run.best.get("value")
        text = f"step {run.best.get('step')}"
        if "metric" in run.best:
            text += f": {run.best['metric']} = {_fmt(value)}"
        facts.append(("best checkpoint", text))
    else:
        facts.append(("best checkpoint", "none (no best/)"))
    facts.append(("report generated", _when(datetime.datetime.now().timestamp())))
    return facts


def _series_rows(run: _Run) -> list[list[Any]]:
    rows = []
    for s in sorted(run.series, key=lambda s: (s.source != layout.TRAIN, s.metric != "loss", s.metric, s.source)):
        finite = [(step, v) for step, v in zip(s.steps, s.values) if math.isfinite(v)]
        bad = len(s.values) - len(finite)
        rows.append([s.source, s.metric, len(s.values), s.steps[-1], s.values[-1],
                     min(v for _, v in finite) if finite else "", max(v for _, v in finite) if finite else "",
                     bad or ""])
    return rows


def _evaluation_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in records:
        if r.get("status") == "evaluated" and isinstance(r.get("metrics"), Mapping):
            detail = "  ".join(f"{k}={_fmt(v)}" for k, v in r["metrics"].items())
        else:
            detail = r.get("error", "")
        duration = r.get("duration_s")
        rows.append([r.get("step"), r.get("status"), _when(r.get("time")),
                     f"{duration:.3g} s" if isinstance(duration, (int, float)) else "", detail])
    return rows


def _checkpoint_rows(run: _Run) -> list[list[Any]]:
    best_step = run.best.get("step") if run.best else None
    latest = run.checkpoints[-1]["step"] if run.checkpoints else None
    rows = []
    for c in run.checkpoints:
        notes = [n for n, on in (("FINAL", c["step"] == run.final_step), ("best", c["step"] == best_step),
                                 ("latest", c["step"] == latest)) if on]
        if c.get("error"):
            notes.append(f"unreadable: {c['error']}")
        rows.append([c["step"], _when(c["time"]), _size(c["size"]), c["files"], ", ".join(notes)])
    return rows


def _page(run: _Run, png: bytes) -> str:
    status = ('<span class="ok">finished</span>' if run.final_step is not None
              else '<span class="warn">not finished</span>')
    facts = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in _facts(run))
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8">{HTML_GENERATOR}',
        f"<title>cadence report: {_e(run.model_dir)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f"<h1>cadence run report &mdash; {status}</h1>",
        f'<p class="sub">{_e(run.model_dir)}</p>',
        f'<table class="facts"><tbody>{facts}</tbody></table>',
        "<h2>Metrics</h2>",
        f'<img class="plots" alt="metrics against step" src="data:image/png;base64,{base64.b64encode(png).decode()}">',
    ]
    if run.series:
        parts.append(_table(["source", "metric", "points", "last step", "last", "min", "max", "non-finite"],
                            _series_rows(run)))
    else:
        parts.append('<p class="empty">no metrics recorded yet</p>')
    if run.replica_groups is not None:
        parts.append(replica_section(run.replica_groups))
    parts.append("<h2>Sidecar evaluations</h2>")
    if run.evaluations:
        for name, records in sorted(run.evaluations.items()):
            parts.append(f"<p>{_e(name)}/evaluations.jsonl: {len(records)} records</p>")
            parts.append(_table(["step", "status", "time", "duration", "metrics / failure"],
                                _evaluation_rows(records)))
    else:
        parts.append('<p class="empty">no sidecar evaluations (no evaluations.jsonl)</p>')
    parts.append("<h2>Checkpoints</h2>")
    if run.checkpoints:
        parts.append(_table(["step", "committed", "size", "files", ""], _checkpoint_rows(run)))
    else:
        parts.append('<p class="empty">no committed checkpoints</p>')
    if run.notes:
        parts.append("<h2>Could not read</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in run.notes) + "</ul>")
    parts.append("<h2>Config</h2>")
    if run.config_text is not None:
        parts.append(f"<pre>{_e(run.config_text)}</pre>")
    else:
        parts.append(f'<p class="empty">no {_e(layout.CONFIG)}</p>')
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# entry point


def build_report(model_dir: str, out: str | None = None) -> ReportPaths:
    """Write the HTML report of ``model_dir`` and its PNG figure; return their paths.

    ``out``: the HTML page's path (local or an fsspec URL); ``None``: ``<model_dir>/report.html``.
    The PNG is written next to it with the same stem (``report.png``). Either replaces only a
    report cadence wrote, atomically on local disks (:mod:`cadence.reports.outputs`). Nothing else
    is written; ``checkpoints/`` is only read.

    Raises:
      ModelDirError: ``model_dir`` does not exist or is not a cadence model dir (no config.yaml,
        checkpoints/ or train/).
      CadenceError: matplotlib is not installed (the message says how to install it).
      ConfigError: ``out`` ends with ``.png`` or lies under ``checkpoints/``; the page's or the
        PNG's path holds anything but a report cadence wrote (checked before the report is built).
    """
    storage = _check_model_dir(model_dir)
    html_path, png_path = report_paths(model_dir, out)
    label = "--out" if out is not None else "report"
    check_report_targets(html_path, png_path, label)
    run = _read_run(model_dir, storage)
    png = _plot(run)
    html, png_url = write_report(html_path, _page(run, png).encode("utf-8"), png_path, png, label)
    return ReportPaths(html=html, png=png_url)
