"""Where asynchronous saves start to pay: the loop benchmark's workload (:mod:`loop_overhead`) with
a checkpoint every 500 steps, its model carrying ``MiB`` of extra state (a buffer the steps do not
touch), saved synchronously and asynchronously.

For each size: the run's time with each mode (median over interleaved repeats) and the measured
write and commit of a synchronous save (``CheckpointManager.save_mode.last_cost``). Asynchronous
pays where its run is faster; ``checkpoint.async_save: auto`` goes asynchronous above the
synchronous cost measured at that crossover (:data:`cadence.checkpoint.save_mode.AUTO_COST_THRESHOLD`).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop_overhead  # noqa: E402

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


def run(repeats: int = 5, sizes: tuple[int, ...] = SIZES_MIB) -> dict:
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
                     "sync_save_ms": statistics.median(costs[mib]) * 1e3 if costs[mib] else None})
    return {"steps": loop_overhead.STEPS, "repeats": repeats, "rows": rows}


def markdown_lines(r: dict) -> list[str]:
    lines = [f"## Sync or async saves ({r['steps']} steps, a save every 500, {r['repeats']} interleaved repeats)\n",
             "| extra state | run, sync (s, min) | run, async (s, min) | async / sync (min) | async / sync (median) "
             "| sync save's write + commit (ms, median) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['mib']} MiB | {row['sync_s']:.3f} | {row['async_s']:.3f} | {row['async_over_sync']:.3f} | "
              f"{row['async_over_sync_median']:.3f} | {row['sync_save_ms']:.1f} |" for row in r["rows"]]
    return lines


if __name__ == "__main__":
    sizes = tuple(int(a) for a in sys.argv[2].split(",")) if len(sys.argv) > 2 else SIZES_MIB
    result = run(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sizes)
    print("\n".join(markdown_lines(result)))
