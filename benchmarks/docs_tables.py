"""The measured tables of the README and ``docs/guide/performance.md``, regenerated from ``results/``.

Each table sits in its page between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, where NAME is
a benchmark (a key of :data:`RENDERERS`) or ``headline`` (the README's summary of the targets). Its
results are ``results/latest.json``'s entry NAME when ``make bench`` measured it, else the file the
benchmark writes on its own (:data:`OWN_FILES`). ``make bench`` rewrites every block after its run;
``python benchmarks/docs_tables.py`` does it alone (after ``make bench-gpu``, or a benchmark run with
``--out``), and ``--check`` exits 1 naming the stale pages. ``tests/unit/test_bench_docs.py`` fails
while a page is stale, so a figure in the docs is always one the results hold.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # (imports `benchmarks`: see its __init__)

HERE = Path(__file__).resolve().parent

from benchmarks.checkpoint import save_load_page as checkpoint_markdown  # noqa: E402
from benchmarks.checkpoint import stall_cuda as checkpoint_stall_cuda  # noqa: E402
from benchmarks.checkpoint import stall_page as checkpoint_stall_page  # noqa: E402
from benchmarks.checkpoint.throughput import TARGETS as CHECKPOINT_TARGETS  # noqa: E402
from benchmarks.loop import compile_speed  # noqa: E402
from benchmarks.loop import ema_overhead  # noqa: E402
from benchmarks.loop import gpu_loop  # noqa: E402
from benchmarks.loop import mesh_step_time  # noqa: E402
from benchmarks.faults import goodput  # noqa: E402
from benchmarks.faults import goodput_nodes  # noqa: E402
from benchmarks.faults import replica_goodput  # noqa: E402
from benchmarks.loop import overhead as loop_overhead  # noqa: E402
from benchmarks.loop import profiler_overhead  # noqa: E402
from benchmarks.checkpoint import resume_cost  # noqa: E402
from benchmarks.checkpoint import save_mode_crossover  # noqa: E402
from benchmarks.sidecar import latency as sidecar_latency  # noqa: E402
from benchmarks.loop import throughput_overhead  # noqa: E402

RESULTS = HERE / "results"
PAGES = (HERE.parent / "README.md", HERE.parent / "docs" / "guide" / "performance.md")

RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "loop": loop_overhead.markdown_lines,
    "checkpoint": checkpoint_markdown.checkpoint_lines,
    "stall": checkpoint_stall_page.markdown_lines,
    "stall_cuda": checkpoint_stall_cuda.markdown_lines,
    "crossover": save_mode_crossover.markdown_lines,
    "sharded": checkpoint_markdown.sharded_lines,
    "sidecar": sidecar_latency.markdown_lines,
    "resume": resume_cost.markdown_lines,
    "goodput": goodput.markdown_lines,
    "goodput_nodes": goodput_nodes.markdown_lines,
    "replica_goodput": replica_goodput.markdown_lines,
    "compile": compile_speed.markdown_lines,
    "profiler": profiler_overhead.markdown_lines,
    "throughput": throughput_overhead.markdown_lines,
    "ema": ema_overhead.markdown_lines,
    "mesh": mesh_step_time.markdown_lines,
    "gpu_loop": gpu_loop.markdown_lines,
}
"""Each benchmark's tables, in the order of ``make bench``'s page."""

OWN_FILES = {"stall": "checkpoint_stall", "stall_cuda": "checkpoint_stall_cuda", "crossover": "save_mode_crossover",
             "sharded": "sharded_checkpoint",
             "goodput_nodes": "goodput_nodes", "replica_goodput": "replica_goodput", "compile": "compile_speed",
             "profiler": "profiler_overhead",
             "throughput": "throughput_overhead", "ema": "ema_overhead", "mesh": "mesh_step_time",
             "gpu_loop": "gpu_loop"}
"""The results file (in ``results/``, without ``.json``) a benchmark writes when run on its own."""

UNMEASURED = {"stall_cuda": "Not measured yet: needs a CUDA device (`make bench-gpu`).",
              "gpu_loop": "Not measured yet: needs a CUDA device (`make bench-gpu`)."}
"""What a block of a benchmark ``make bench`` does not run says until its results file exists."""

BLOCK = re.compile(r"(<!-- bench:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.DOTALL)


def load(results_dir: Path = RESULTS) -> dict[str, dict]:
    """Every benchmark's latest results by name: ``latest.json``'s entries, then the own files for the
    benchmarks it lacks. (An entry's ``machine`` is where and when it ran; ``latest.json``'s own
    ``machine`` is only its last run's, so older entries without one say so.)"""
    found: dict[str, dict] = {}
    latest = results_dir / "latest.json"
    if latest.exists():
        data = json.loads(latest.read_text())
        for name, result in data.items():
            if name in RENDERERS:
                found[name] = result
    for name, stem in OWN_FILES.items():
        path = results_dir / f"{stem}.json"
        if name not in found and path.exists():
            found[name] = json.loads(path.read_text())
    return found


def _measured(m: dict | str | None) -> str:
    if not m:
        return "Measured: the machine and date were not recorded."
    if isinstance(m, str):
        return f"Measured on {m}."
    load = m.get("load_average_1min")
    return (f"Measured on {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, {m['date']}"
            + (f"; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end" if load else "") + ".")


def _ratio(value: float) -> str:
    return f"{value:.2f}×"


def _fine_ratio(value: float) -> str:  # near a bound of two decimals: the side it falls on shows
    return f"{value:.3f}×"


def _percent(value: float) -> str:
    return f"{value * 100:.1f}%" if value >= 0.001 else f"{value * 100:.2f}%"


def _row(what: str, figures: list[tuple[str, float, bool]], show: Callable[[float], str],
         target: str) -> tuple[str, str, str, bool]:
    """One headline row from ``(label, value, met)`` per state: the figures side by side, met when all are."""
    shown = " · ".join(f"{label} {show(value)}" if label else show(value) for label, value, _ in figures)
    return what, shown, target, all(met for _, _, met in figures)


STALL_TARGETS = {"stall_fraction": "asynchronous save: training's stall, saves 2+ (of a sync save)",
                 "first_stall_fraction": "asynchronous save: the first save's stall (of a sync save)",
                 "step_ratio_during_save": "steps during an asynchronous save (× steps alone)",
                 "peak_rss_x_state": "peak memory during an asynchronous save (× the state)"}


def headline_lines(results: dict[str, dict]) -> list[str]:
    """The README's table: each headline target, its figures and whether all are met, from ``results``."""
    rows: list[tuple[str, str, str, bool]] = []  # what, figures, target, met
    if "loop" in results:
        for t in results["loop"].get("targets", []):
            what = t["contender"].removeprefix("cadence (").removesuffix(")")  # "cadence (what)"
            rows.append(_row(f"cadence's loop, {what} (× a hand-written loop, paired)",
                             [("", t["value"], t["met"])], _fine_ratio, f"≤ {t['bound']:.2f}×"))
    if "checkpoint" in results:
        sizes = results["checkpoint"]["sizes"]
        for name, what in (("save_vs_raw", "checkpoint save, every byte checksummed and fsynced (× raw safetensors)"),
                           ("load_vs_raw", "checkpoint load into the live optimizer, every byte verified (× raw)")):
            figures = [(size["label"], t["value"], t["met"]) for size in sizes for t in size["targets"]
                       if t["name"] == name]
            if figures:
                rows.append(_row(what, figures, _ratio, f"≥ {CHECKPOINT_TARGETS[name]:.2f}×"))
        loads = results["checkpoint"].get("loads") or []
        fresh = [(shape["label"], row["fresh_ratio_median"], row["fresh_ratio_median"] >= CHECKPOINT_TARGETS["load_vs_raw"])
                 for shape in loads for row in shape["rows"] if row["key"] == "cadence_crc32c"]
        if fresh:
            rows.append(_row("checkpoint load into a new optimizer (a new process's resume; × raw)", fresh, _ratio,
                             f"≥ {CHECKPOINT_TARGETS['load_vs_raw']:.2f}×"))
    if "stall" in results:
        states = results["stall"]["states"]
        for name, what in STALL_TARGETS.items():
            found = [(state["label"], t) for state in states for t in state["targets"] if t["name"] == name]
            figures = [(label, t["value"], t["met"]) for label, t in found]
            if figures:
                bound = found[0][1]["bound"]
                percent = name.endswith("fraction")
                show = _percent if percent else _fine_ratio if name == "step_ratio_during_save" else _ratio
                rows.append(_row(what, figures, show,
                                 f"≤ {bound * 100:.0f}%" if percent else f"≤ {bound:.2f}×"))
    if "stall_cuda" in results:
        r = results["stall_cuda"]
        ms = next(row for row in r["state"]["rows"] if row["key"] == "pipelined")["step_stall_s"] * 1e3
        rows.append(_row(f"asynchronous save on {r['device_name']}: the device's stall, saves 2+ "
                         f"(GPT-2 small + AdamW, {r['state']['state_gib']:.2f} GiB)", [("", ms, ms < 50)],
                         lambda v: f"{v:.0f} ms", "< 50 ms"))
        first = r.get("first_target")
        honest = all(row.get("pinned_released_after") for row in r["state"]["rows"] if row["key"] != "floor")
        if first is not None and honest:  # (before, a first save could reuse another contender's pinned memory)
            rows.append(_row("the same: the first save's stall (of a sync save)", [("", first["value"], first["met"])],
                             _percent, f"≤ {first['bound'] * 100:.0f}%"))
    if "gpu_loop" in results:
        r = results["gpu_loop"]
        rows.append(_row(f"cadence's loop on GPT-2 small, bf16, {r['device']} (× a hand-written loop, paired)",
                         [(s["compile"] or "eager", s["target"]["value"], s["target"]["met"]) for s in r["settings"]],
                         _fine_ratio, f"≤ {r['settings'][0]['target']['bound']:.2f}×"))
    if "sidecar" in results:
        median = results["sidecar"]["median_s"]
        rows.append(_row("sidecar: a commit to its evaluation starting (median)", [("", median, median <= 1)],
                         lambda v: f"{v:.2f} s", "≤ 1 s"))
    lines = ["| measured by `make bench` | figure | target | met |", "|---|---|---|---|"]
    lines += [f"| {what} | {figure} | {target} | {'yes' if met else '**no**'} |" for what, figure, target, met in rows]
    return lines


def block_lines(name: str, results: dict[str, dict]) -> list[str]:
    """Block ``name``'s lines: ``headline``, or the benchmark's tables and where they were measured."""
    if name == "headline":
        return headline_lines(results)
    if name not in RENDERERS:
        raise KeyError(f"unknown benchmark block {name!r}; known: headline, {', '.join(RENDERERS)}")
    if name not in results:
        return [UNMEASURED.get(name, f"(No results for `{name}` in benchmarks/results/: run `make bench`.)")]
    result = results[name]
    return [*RENDERERS[name](result), _measured(result.get("machine"))]


def render(text: str, results: dict[str, dict]) -> str:
    """``text`` with every block's body made anew from ``results``."""
    def body(match: re.Match[str]) -> str:
        lines = "\n".join(block_lines(match["name"], results)).strip("\n")
        return f"{match[1]}{lines}\n{match[4]}"

    return BLOCK.sub(body, text)


def regenerate(pages: tuple[Path, ...] = PAGES, results_dir: Path = RESULTS, check: bool = False) -> list[Path]:
    """Rewrite the blocks of ``pages`` from ``results_dir`` (``check``: write nothing); the pages that
    were (or, checking, would be) changed."""
    results = load(results_dir)
    changed = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        new = render(text, results)
        if new != text:
            changed.append(page)
            if not check:
                page.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="regenerate the README's and the performance page's measured tables")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    changed = regenerate(check=args.check)
    for page in changed:
        print(f"{page.relative_to(HERE.parent)}: {'stale' if args.check else 'regenerated'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
