"""The tables of ``stall.py``'s results (``stall.run``): a section per state,
the contenders' stalls side by side, and each target met or missed with why."""

from __future__ import annotations

import os


def _pct(row: dict, key: str) -> str:
    if row.get(key) is None:
        return "—"
    return f"{row[key[: -len('fraction')] + 's']:.3f} ({row[key] * 100:.1f}%)"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _verdict(t: dict) -> str:
    value = "n/a" if t["value"] is None else (f"{t['value'] * 100:.1f}%" if t["name"].endswith("fraction")
                                               else f"{t['value']:.2f}x")
    bound = f"{t['bound'] * 100:.0f}%" if t["name"].endswith("fraction") else f"{t['bound']:.2f}x"
    return f"{value} (<= {bound}: {({True: 'met', False: '**missed**', None: 'not measured'})[t['met']]})"


TARGET_NAMES = {"stall_fraction": "stall, saves 2+ / sync save", "step_ratio_during_save": "steps during a save",
                "peak_rss_x_state": "peak RSS during a save / state", "first_stall_fraction": "first save's stall / sync save"}


def _why(t: dict, s: dict, rows: dict[str, dict]) -> str:
    """What the table says about a missed target."""
    cad, floor = rows["pipelined"], rows["floor"]
    if t["name"] in ("stall_fraction", "first_stall_fraction") and cad["boundary_s"] >= cad["wait_s"]:
        return (f"the save call itself takes {cad['boundary_s']:.3f} s (saves 2+; {cad['first_stall_s']:.3f} s the "
                f"first): what is copied and done at the boundary, on the training thread, against a copy floor "
                f"of {floor['stall_s']:.3f} s for the whole state")
    if t["name"] in ("stall_fraction", "first_stall_fraction"):
        return (f"the boundary part is {cad['boundary_s']:.3f} s and the wait before the optimizer step "
                f"{cad['wait_s']:.3f} s (saves 2+; the first: {cad['first_boundary_s']:.3f} s + "
                f"{cad['first_wait_s']:.3f} s, its copy allocating the staging memory): the copy "
                f"({floor['stall_s']:.3f} s alone, slower beside "
                f"training on {os.cpu_count()} cores) outlasts the forward and backward pass "
                f"({cad['step_s_idle']:.3f} s a whole step)")
    if t["name"] == "peak_rss_x_state":
        return (f"training alone already peaks at {cad['rss_alone_x_state']:.2f}x (parameters, gradients, Adam's "
                f"moments and its temporaries, activations, the interpreter and torch); the save adds "
                f"{cad['peak_rss_x_state'] - cad['rss_alone_x_state']:.2f}x (the staging copy)")
    return (f"the copy and the background commit's checksums and writes run on another core beside training "
            f"({os.cpu_count()} cores), and on a shared VM any work there slows the training core (a pure spin "
            f"loop too: `benchmarks/checkpoint/step_interference.py` measures each kind); load average "
            f"{s['load_average_1min'][0]:.1f}")


def _cells(row: dict) -> list[str]:
    """The boundary + wait, save to committed, step ratio and RSS cells of ``row``."""
    if "background_s" not in row:  # the floor
        return ["—"] * 4
    parts = (f"{row['first_boundary_s']:.3f} + {row['first_wait_s']:.3f}; {row['boundary_s']:.3f} + {row['wait_s']:.3f}"
             if row["key"] in ("pipelined", "dcp") else "—")
    rss = f"{row['peak_rss_x_state']:.2f}x ({row['rss_alone_x_state']:.2f}x)"
    return [parts, f"{row['background_s']:.2f}", _x(row["step_ratio_during_save"]), rss]


def markdown_lines(r: dict) -> list[str]:
    """The tables of :func:`run`'s result ``r``, one per state."""
    lines = []
    for s in r["states"]:
        rows = {row["key"]: row for row in s["rows"]}
        sync = rows["sync"]
        lines += [(f"## Checkpoint stall: training beside an asynchronous save, {s['label']} "
                   f"({_size(s['state_bytes'])}: {s['workload']}; {s['saves']} saves each, training at "
                   f"{s['torch_threads']} torch thread(s){', quick' if r.get('quick') else ''})\n"),
                  "| contender | first save: stall s (/ sync) | saves 2+: stall s (/ sync) | boundary + wait s: first; 2+ | "
                  "save to committed s | step during a save | peak RSS / state (alone) |",
                  "|---|---|---|---|---|---|---|"]
        for row in s["rows"]:
            lines.append(f"| {row['contender']} | {_pct(row, 'first_stall_fraction')} | {_pct(row, 'stall_fraction')} | "
                         + " | ".join(_cells(row)) + " |")
        lines.append(
            f"\nStall: how long the training thread stops for a save (sync: the whole save; floor: one copy of "
            f"every tensor into allocated memory, the least a copy at the boundary costs; async: the save call, "
            f"plus, pipelined and DCP, the wait before the next optimizer step). Step during a save: mean step "
            f"while the save is in flight (less its wait) over the mean step alone "
            f"({rows['pipelined']['step_s_idle']:.3f} s, pipelined contender); sync save {sync['stall_s']:.2f} s. "
            f"Peak RSS: /proc/self/statm every {r.get('rss_every_s', 0.005) * 1e3:.0f} ms from the save call to the commit, over "
            f"the state's bytes; in brackets the peak while training alone before the first save. Load average "
            f"(1 min) {s['load_average_1min'][0]:.1f} at the start, {s['load_average_1min'][1]:.1f} at the end.\n")
        lines.append("Targets, cadence pipelined: " + "; ".join(
            f"{TARGET_NAMES[t['name']]} {_verdict(t)}" + (f", because {_why(t, s, rows)}" if t["met"] is False else "")
            for t in s["targets"]) + ".\n")
    return lines
