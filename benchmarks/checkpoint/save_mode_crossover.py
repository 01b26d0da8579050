"""Where asynchronous saves start to pay: the loop benchmark's workload (:mod:`loop_overhead`) with
a checkpoint every 500 steps, its model carrying ``MiB`` of extra state (a buffer the steps do not
touch), saved synchronously and asynchronously.

For each size: the run's time with each mode (the minimum over interleaved repeats), async over
sync (of the minimums, of the medians, and paired: the median of each repeat's ratio), and the
measured write and commit of a synchronous save (``CheckpointManager.save_mode.last_cost``).
Asynchronous pays where its run is faster; ``checkpoint.async_save: auto`` goes asynchronous above
the synchronous cost measured at that crossover (:data:`cadence.checkpoint.save_mode.AUTO_COST_THRESHOLD`).

    OMP_NUM_THREADS=1 python benchmarks/checkpoint/save_mode_crossover.py [--repeats 7] [--sizes 0,1,4,16,64]
        [--out benchmarks/results/save_mode_crossover.md]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)
from benchmarks.loop import overhead as loop_overhead  # noqa: E402

SIZES_MIB = (0, 1, 4, 16, 64)


def _task(batches, mib: int):
    task = loop_overhead._cadence_task(batches)

    def build_model() -> nn.Module:
        model = loop_overhead.make_model()
        if mib:
            model.register_buffer("ballast", torch.zeros(mib << 18))  # float32: 4 bytes each
        return model

    task.build_model = build_model  # type: ignore[method-assign]
    return task


def timed(batches, mib: int, async_save: bool | str) -> tuple[float, float | None]:
    """``(seconds of the run, the last save's measured write and commit)``."""
    from cadence import CheckpointManager, Controller
    from cadence.torch import Context, build_runners

    trainer, _ = build_runners(_task(batches, mib), Context.create(device="cpu"), evaluate=False)
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(f"{tmp}/checkpoints", max_to_keep=2, async_save=async_save)
        controller = Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=100,
                                checkpoint_interval=500, summary_dir=f"{tmp}/train", progress=False)
        start = time.perf_counter()
        controller.train(loop_overhead.STEPS, checkpoint_at_completion=True)
        controller.close()
        elapsed = time.perf_counter() - start
    return elapsed, manager.save_mode.last_cost


def run(repeats: int = 7, sizes: tuple[int, ...] = SIZES_MIB) -> dict:
    torch.set_num_threads(1)
    batches = loop_overhead.make_batches()
    modes = {"sync": False, "async": True}
    times = {(mib, mode): [] for mib in sizes for mode in modes}
    costs: dict[int, list[float]] = {mib: [] for mib in sizes}
    for mib in sizes:  # warm-up
        timed(batches, mib, False)
    for _ in range(repeats):
        for mib in sizes:
            for mode, setting in modes.items():
                elapsed, cost = timed(batches, mib, setting)
                times[(mib, mode)].append(elapsed)
                if mode == "sync" and cost is not None:
                    costs[mib].append(cost)
    rows = []
    for mib in sizes:
        sync, asyn = min(times[(mib, "sync")]), min(times[(mib, "async")])
        rows.append({"mib": mib, "sync_s": sync, "async_s": asyn, "async_over_sync": asyn / sync,
                     "async_over_sync_median": statistics.median(times[(mib, "async")])
                     / statistics.median(times[(mib, "sync")]),
                     "async_over_sync_paired": statistics.median(
                         a / b for a, b in zip(times[(mib, "async")], times[(mib, "sync")])),
                     "sync_save_ms": statistics.median(costs[mib]) * 1e3 if costs[mib] else None})
    from cadence.checkpoint.save_mode import AUTO_COST_THRESHOLD

    return {"steps": loop_overhead.STEPS, "repeats": repeats, "rows": rows, "auto_cost_threshold_s": AUTO_COST_THRESHOLD}


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## Synchronous or asynchronous saves: the crossover ({r['steps']} steps of the loop benchmark's MLP, "
              f"a save every 500, {r['repeats']} interleaved repeats)\n"),
             "| extra state | run, sync (s, min) | run, async (s, min) | async / sync (min / median / paired) "
             "| sync save's write + commit (ms, median) |",
             "|---|---|---|---|---|"]
    lines += [f"| {row['mib']} MiB | {row['sync_s']:.3f} | {row['async_s']:.3f} | {row['async_over_sync']:.3f} / "
              f"{row['async_over_sync_median']:.3f} / {row.get('async_over_sync_paired', float('nan')):.3f} | "
              f"{row['sync_save_ms']:.1f} |" for row in r["rows"]]
    if "auto_cost_threshold_s" in r:
        lines.append(f"\n`auto` goes asynchronous once two saves in a row each took more than "
                     f"{r['auto_cost_threshold_s'] * 1e3:.0f} ms to write and commit.\n")
    return lines


def main() -> None:
    import argparse

    from benchmarks.common.results_file import run_on_this_machine, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB of extra state, comma-separated")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    sizes = tuple(int(a) for a in args.sizes.split(","))
    text, result = run_on_this_machine("sync or async saves", "checkpoint/save_mode_crossover.py",
                                       lambda: run(args.repeats, sizes), markdown_lines)
    write_results(args.out, text, result)
    print(text)


if __name__ == "__main__":
    main()
