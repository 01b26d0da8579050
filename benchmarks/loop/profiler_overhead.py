"""Profiler overhead: the training loop with the profiler configured but outside its window, next to
the same loop without a profiler; and, for reference, the steps inside a window.

    OMP_NUM_THREADS=1 python benchmarks/loop/profiler_overhead.py [--quick] [--out benchmarks/results/profiler_overhead.md]

The workload of the loop benchmark (``loop/overhead.py``: a 32-64-10 MLP, batch 16, SGD, batches
in memory, one torch thread) through cadence's ``Controller`` and ``TorchTrainer``. Each run first
trains ``WARMUP`` untimed steps -- for the profiled contender these hold the default window
(``profiler:`` defaults, steps 13-15: a real trace is written), so the timed steps come *after* a
window, with the profiler's step hook still installed (one integer comparison per step) -- then
times ``steps`` steps. The two contenders are interleaved (their order alternating) and repeated.
Each timing is taken twice: the process's CPU time (all its threads: what the run costs, whatever
else the machine runs) and wall time. Reported: microseconds per step (min and median) and the
ratio to the loop without a profiler. Target: <= 1.02x, CPU time, of the medians (wall times on a
busy machine move by several per cent either way from one run to the next: shown, not judged).
The step hook's call alone is timed too.

For reference (no target): a window recording every timed step (CPU activities, no shapes, memory
or stacks), its µs per step and ratio, and the time and size of writing that trace.
``benchmarks/run.py`` runs it as ``profiler``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.loop import overhead as loop_overhead  # noqa: E402  (the same model and task)
from benchmarks.common.results_file import quick_main  # noqa: E402

WARMUP = 20
FULL = {"steps": 2000, "repeats": 15, "inside_steps": 500}
QUICK = {"steps": 100, "repeats": 1, "inside_steps": 30}
TARGET = 1.02
CONTENDERS = ("no profiler", "profiler outside its window")


def make_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(loop_overhead.BATCH, 32, generator=g), torch.randint(0, 10, (loop_overhead.BATCH,), generator=g))
            for _ in range(n)]


def timed_run(batches: list, steps: int, profiler: dict | None,
              directory: str) -> tuple[float, float, list[str], float]:
    """Train ``WARMUP`` steps untimed, then ``steps`` timed; ``(cpu_seconds, wall_seconds, traces,
    close_seconds)``. ``profiler``: ProfilerConfig settings (None: no profiler). ``close_seconds``:
    the controller's close (wall), which writes a trace the timed steps left open."""
    from cadence import Controller
    from cadence.config.components.profiler import ProfilerConfig
    from cadence.torch import Context, build_runners
    from cadence.torch.components.profiling import StepProfiler

    trainer, _ = build_runners(loop_overhead._cadence_task(batches), Context.create(device="cpu"), evaluate=False)
    callbacks = []
    hook = None
    if profiler is not None:
        hook = StepProfiler(ProfilerConfig(**profiler), directory)
        callbacks.append(hook)  # one callback: per step (on_train_step_end), at the start and the close
    controller = Controller(trainer=trainer, steps_per_loop=100, callbacks=callbacks, progress=False)
    controller.train(WARMUP, checkpoint_at_completion=False)
    cpu, wall = time.process_time(), time.perf_counter()
    controller.train(WARMUP + steps, checkpoint_at_completion=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    start = time.perf_counter()
    controller.close()
    closed = time.perf_counter() - start
    return cpu, wall, list(hook.traces) if hook else [], closed


def hook_call_ns(calls: int = 1_000_000, repeats: int = 5) -> float:
    """Nanoseconds per ``StepProfiler.on_train_step_end`` call outside a window (min over repeats, the
    loop's own iteration included): what a step pays for the profiler outside its window."""
    from cadence.config.components.profiler import ProfilerConfig
    from cadence.torch.components.profiling import StepProfiler

    hook = StepProfiler(ProfilerConfig(skip_first=10, wait=1, warmup=1, active=3), "unused")
    hook.on_train_step_end(None, 100)  # past the window: nothing left to start (the profiler needs no run here)
    step_end, steps = hook.on_train_step_end, range(101, 101 + calls)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for step in steps:
            step_end(None, step)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e9


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    steps, repeats = p["steps"], p["repeats"]
    torch.set_num_threads(1)
    batches = make_batches(WARMUP + max(steps, p["inside_steps"]) + 1)
    outside = {"skip_first": 10, "wait": 1, "warmup": 1, "active": 3, "repeat": 1}  # the defaults: steps 13-15
    settings = {"no profiler": None, "profiler outside its window": outside}
    times: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in CONTENDERS}
    traces_after_window = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONTENDERS:  # warm-up: imports, first-call costs, the profiler's first start
            timed_run(batches, 50, settings[name], f"{tmp}/warm")
        for i in range(repeats):
            for name in CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]:  # interleaved, the order alternating
                cpu, wall, traces, _ = timed_run(batches, steps, settings[name], f"{tmp}/{i}")
                times[name]["cpu"].append(cpu)
                times[name]["wall"].append(wall)
                traces_after_window += len(traces)
        inside = {"skip_first": WARMUP - 1, "wait": 0, "warmup": 1, "active": p["inside_steps"] + 1, "repeat": 1}
        inside_cpu, _, _, write_s = timed_run(batches, p["inside_steps"], inside, f"{tmp}/inside")
        written = sorted(Path(tmp, "inside").iterdir())
        trace_mib = sum(f.stat().st_size for f in written) / 2**20
    base = times["no profiler"]
    rows = []
    for name, kinds in times.items():
        row: dict = {"contender": name}
        for kind, ts in kinds.items():
            row[f"{kind}_us_per_step_min"] = min(ts) / steps * 1e6
            row[f"{kind}_us_per_step_median"] = statistics.median(ts) / steps * 1e6
            row[f"{kind}_ratio_min"] = min(ts) / min(base[kind])
            row[f"{kind}_ratio_median"] = statistics.median(ts) / statistics.median(base[kind])
        rows.append(row)
    ratio = rows[1]["cpu_ratio_median"]
    return {
        "steps": steps, "batch": loop_overhead.BATCH, "repeats": repeats, "warmup_steps": WARMUP, "quick": quick,
        "rows": rows, "traces_in_warmup": traces_after_window,
        "hook_ns_per_step": hook_call_ns(100_000 if quick else 1_000_000),
        "target": {"name": "profiler outside its window / no profiler (CPU time, medians)", "bound": TARGET,
                   "value": ratio, "met": ratio <= TARGET},
        "inside": {"steps": p["inside_steps"], "cpu_us_per_step": inside_cpu / p["inside_steps"] * 1e6,
                   "cpu_ratio_to_no_profiler_median": inside_cpu / p["inside_steps"]
                   / (statistics.median(base["cpu"]) / steps),
                   "trace_write_s": write_s, "trace_mib": trace_mib, "traces": len(written)},
    }


def markdown_lines(r: dict) -> list[str]:
    t, inside = r["target"], r["inside"]
    base = r["rows"][0]["cpu_us_per_step_median"]
    lines = [(f"## Profiler overhead outside its window ({r['steps']} steps after {r['warmup_steps']} untimed ones, "
              f"batch {r['batch']}, {r['repeats']} interleaved repeats{', quick' if r.get('quick') else ''})\n"),
             "| contender | CPU µs/step (min / median) | × none, CPU (min / median) | wall µs/step (min / median) | "
             "× none, wall (min / median) |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        cells = [f"{row[f'{k}_us_per_step_min']:.1f} / {row[f'{k}_us_per_step_median']:.1f} | "
                 f"{row[f'{k}_ratio_min']:.3f} / {row[f'{k}_ratio_median']:.3f}" for k in ("cpu", "wall")]
        lines.append(f"| {row['contender']} | {cells[0]} | {cells[1]} |")
    lines += [(f"\nCPU time: the process's, all threads. The profiled runs traced the default window (steps 13-15) "
               f"in their untimed steps ({r['traces_in_warmup']} traces written); the timed steps run after it, the "
               f"step hook installed. Target: {t['name']} <= {t['bound']:.2f}x: {t['value']:.3f}x, "
               f"{'met' if t['met'] else '**missed**'}. The hook's call outside a window, alone: "
               f"{r['hook_ns_per_step']:.0f} ns per step ({r['hook_ns_per_step'] / 1e3 / base:.2%} of the median "
               f"CPU time of a step without a profiler).\n"),
              (f"Inside a window, for reference: {inside['steps']} recorded steps at {inside['cpu_us_per_step']:.1f} "
               f"CPU µs/step ({inside['cpu_ratio_to_no_profiler_median']:.2f}x the loop without a profiler; CPU "
               f"activities, no shapes, memory or stacks); writing their trace ({inside['trace_mib']:.1f} MiB) took "
               f"{inside['trace_write_s']:.2f} s, at the step that ends the window.\n")]
    return lines


def main() -> None:
    quick_main(__doc__, "profiler overhead", "loop/profiler_overhead.py", run, markdown_lines)


if __name__ == "__main__":
    main()
