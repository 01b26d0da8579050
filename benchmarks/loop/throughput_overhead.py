"""Throughput logging overhead: the training loop logging samples/s (and tokens/s, and MFU with its
one-off FLOPs count) next to the same loop with ``trainer.log_throughput: false``.

    OMP_NUM_THREADS=1 python benchmarks/loop/throughput_overhead.py [--quick] [--out benchmarks/results/throughput_overhead.md]

The workload of the loop benchmark (``loop/overhead.py``: a 32-64-10 MLP, batch 16, SGD, batches in
memory, one torch thread) through cadence's ``Controller`` and ``TorchTrainer``, 100 steps per loop,
train summaries (TensorBoard + ``metrics.jsonl``) written after every loop. Each run builds a fresh
trainer, trains one untimed loop (``WARMUP`` steps: after it the MFU contender counts the FLOPs,
once), then times ``steps`` steps: the steady state. Contenders are interleaved (each repeat starts
with the next one: no contender always runs first) and repeated;
reported, by the wall clock and by the process's CPU time: microseconds per step (min and median),
the ratio of each to the loop without throughput logging (of the minimums, of the medians) and the
median over the repeats of the ratio within each repeat (the runs of one repeat follow each other,
so slow phases of a shared machine cancel out). Target: every contender <= 1.02x by that last
ratio of CPU times (a shared 2-core machine's wall clock measures its neighbours).

Also measured: the one-off FLOPs count on the meta device in ms (a cost per run, not per step),
and one count of a batch (``Task.batch_size_of``, and with ``Task.tokens_per_batch``) in µs.
``benchmarks/run.py`` runs it as ``throughput``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.loop import overhead as loop_overhead  # noqa: E402  (the same model and task)
from benchmarks.common.results_file import write_results  # noqa: E402

FULL = {"steps": 2000, "repeats": 21, "timeit": 200_000}
QUICK = {"steps": 100, "repeats": 1, "timeit": 2_000}
TARGET = 1.02
STEPS_PER_LOOP = 100
WARMUP = STEPS_PER_LOOP  # one loop, untimed
BASELINE = "throughput off (trainer.log_throughput: false)"
CONTENDERS = {  # name: (task with tokens_per_batch, trainer keywords)
    BASELINE: (False, {"log_throughput": False}),
    "samples/s (the default)": (False, {}),
    "samples/s + tokens/s (Task.tokens_per_batch)": (True, {}),
    "samples/s + MFU (trainer.peak_tflops: FLOPs counted once)": (False, {"peak_tflops": 1.0}),
}


def make_task(batches: list, tokens: bool):
    task = loop_overhead._cadence_task(batches)
    if tokens:
        cls = type(task)
        task = type("TokenBenchTask", (cls,), {"tokens_per_batch": lambda self, batch: batch[0].numel()})()
    return task


def timed_run(batches: list, steps: int, tokens: bool, trainer_kwargs: dict,
              directory: str) -> tuple[float, float, dict]:
    """Train ``WARMUP`` steps untimed, then ``steps`` timed, from a fresh trainer, summaries into
    ``directory``; the wall seconds, the process's CPU seconds and the last loop's logs."""
    from cadence import Controller
    from cadence.torch import Context, build_runners

    trainer, _ = build_runners(make_task(batches, tokens), Context.create(device="cpu"), evaluate=False,
                               **trainer_kwargs)
    seen: list[dict] = []
    controller = Controller(trainer=trainer, steps_per_loop=STEPS_PER_LOOP, summary_dir=directory, progress=False,
                            train_actions=[seen.append])
    controller.train(WARMUP, checkpoint_at_completion=False)
    start, start_cpu = time.perf_counter(), time.process_time()
    controller.train(WARMUP + steps, checkpoint_at_completion=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    controller.close()
    return elapsed, cpu, seen[-1]


def component_costs(batches: list, n: int) -> dict:
    """The parts, each the best of 5 times ``n`` calls: µs of one count of a batch (the meter's
    per-batch call); µs per loop of the controller's work (``isinstance(trainer, CountsWork)``,
    ``loop_work()``, ``throughput_logs``) and of writing one more scalar into the summaries (with
    their flush); ms of one FLOPs count."""
    from cadence.summaries.manager import SummaryManager
    from cadence.summaries.throughput import CountsWork, throughput_logs
    from cadence.torch import Context, build_runners
    from cadence.torch.components.throughput import ThroughputMeter, count_flops_per_sample

    batch = batches[0]
    costs = {}
    for key, tokens in (("count_us", False), ("count_with_tokens_us", True)):
        meter = ThroughputMeter(make_task(batches, tokens), Context(), "32")
        count = meter.start_loop()
        costs[key] = min(timeit.repeat(functools.partial(count, batch), number=n, repeat=5)) / n * 1e6
    trainer, _ = build_runners(make_task(batches, False), Context(), evaluate=False)
    trainer.train(2)
    costs["per_loop_us"] = min(timeit.repeat(
        lambda: isinstance(trainer, CountsWork) and throughput_logs(trainer.loop_work(), 0.1),
        number=max(1, n // 100), repeat=5)) / max(1, n // 100) * 1e6
    base = {"loss": 0.5, "learning_rate": 0.01, "steps_per_second": 500.0}
    write_us = {0: math.inf, 1: math.inf}
    writes = max(1, n // 1000)
    with tempfile.TemporaryDirectory() as tmp:
        managers = {extra: SummaryManager(f"{tmp}/{extra}") for extra in write_us}
        step = iter(range(1, 10**9))
        for _ in range(7):  # interleaved rounds, the best of each
            for extra, logs in ((0, base), (1, {**base, "samples_per_second": 8000.0})):
                start = time.perf_counter()
                for _ in range(writes):
                    managers[extra].write_summaries(next(step), logs)
                    managers[extra].flush()
                write_us[extra] = min(write_us[extra], (time.perf_counter() - start) / writes * 1e6)
        for summaries in managers.values():
            summaries.close()
    costs["scalar_write_us"] = max(0.0, write_us[1] - write_us[0])  # below the noise: 0
    task = make_task(batches, False)
    costs["flops_count_ms"] = min(timeit.repeat(lambda: count_flops_per_sample(task, batch), number=5, repeat=3)) / 5 * 1e3
    costs["flops_per_sample"] = count_flops_per_sample(task, batch)
    return costs


def _row(name: str, ts: list[float], base: list[float], steps: int, clock: str) -> dict:
    return {f"{clock}_us_per_step_min": min(ts) / steps * 1e6,
            f"{clock}_us_per_step_median": statistics.median(ts) / steps * 1e6,
            f"{clock}_ratio_min": min(ts) / min(base), f"{clock}_ratio_median": statistics.median(ts) / statistics.median(base),
            f"{clock}_ratio_paired_median": statistics.median(t / b for t, b in zip(ts, base))}


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    steps, repeats = p["steps"], p["repeats"]
    torch.set_num_threads(1)
    batches = loop_overhead.make_batches()  # STEPS batches
    batches = (batches * (1 + (WARMUP + steps) // len(batches)))[:WARMUP + steps]
    wall: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    last_logs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (tokens, kwargs) in enumerate(CONTENDERS.values()):  # warm-up: imports, first-call costs
            timed_run(batches, 50, tokens, kwargs, f"{tmp}/warm{i}")
        names = list(CONTENDERS)
        for r in range(repeats):
            for i, name in enumerate(names[r % len(names):] + names[:r % len(names)]):  # interleaved, rotated
                tokens, kwargs = CONTENDERS[name]
                seconds, cpu_seconds, last_logs[name] = timed_run(batches, steps, tokens, kwargs, f"{tmp}/{r}-{i}")
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
    rows = [{"contender": name, **_row(name, wall[name], wall[BASELINE], steps, "wall"),
             **_row(name, cpu[name], cpu[BASELINE], steps, "cpu"),
             "logged": sorted(k for k in last_logs[name] if k not in ("loss", "learning_rate"))}
            for name in CONTENDERS]
    worst = max(row["cpu_ratio_paired_median"] for row in rows[1:])
    return {
        "steps": steps, "warmup_steps": WARMUP, "batch": loop_overhead.BATCH, "repeats": repeats,
        "steps_per_loop": STEPS_PER_LOOP, "quick": quick, "rows": rows, "costs": component_costs(batches, p["timeit"]),
        "target": {"name": "each contender / throughput off (CPU time, median of the repeats' ratios)",
                   "bound": TARGET, "value": worst, "met": worst <= TARGET},
    }


def _estimate(r: dict, scalars: int) -> float:
    """The overhead in % that the parts add up to: the per-batch count, and per loop the
    controller's work and ``scalars`` more summary scalars, over the baseline's minimum µs/step."""
    c = r["costs"]
    per_step = c["count_us"] + (c["per_loop_us"] + scalars * c["scalar_write_us"]) / r["steps_per_loop"]
    return per_step / r["rows"][0]["wall_us_per_step_min"] * 100


def markdown_lines(r: dict) -> list[str]:
    t, c = r["target"], r["costs"]
    lines = [(f"## Throughput logging overhead ({r['steps']} steps after {r['warmup_steps']} untimed ones, batch "
              f"{r['batch']}, {r['steps_per_loop']} steps per loop, summaries every loop, {r['repeats']} interleaved "
              f"repeats{', quick' if r.get('quick') else ''})\n"),
             "| contender | wall µs/step (min / median) | × off: wall (min / median / paired) | CPU µs/step "
             "(min / median) | × off: CPU (min / median / paired) |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        cells = []
        for clock in ("wall", "cpu"):
            cells.append(f"{row[f'{clock}_us_per_step_min']:.1f} / {row[f'{clock}_us_per_step_median']:.1f}")
            cells.append(f"{row[f'{clock}_ratio_min']:.3f} / {row[f'{clock}_ratio_median']:.3f} / "
                         f"{row[f'{clock}_ratio_paired_median']:.3f}")
        lines.append(f"| {row['contender']} | " + " | ".join(cells) + " |")
    lines += [(f"\nPaired: the median over the repeats of the ratio within each repeat. CPU: the process's CPU time "
               f"(`time.process_time`), which a busy shared machine disturbs less than the wall clock. "
               f"Target: {t['name']} <= {t['bound']:.2f}x: worst {t['value']:.3f}x, "
               f"{'met' if t['met'] else '**missed**'}. Per batch, the loop calls the meter once: "
               f"{c['count_us']:.2f} µs (`Task.batch_size_of`), {c['count_with_tokens_us']:.2f} µs with "
               f"`Task.tokens_per_batch`. Per loop: {c['per_loop_us']:.1f} µs of the controller's work "
               f"(`loop_work`, `throughput_logs`) and {c['scalar_write_us']:.1f} µs per scalar more in the summaries; "
               f"so about {_estimate(r, 1):.2f}% of the loop without throughput logging for samples/s (one "
               f"scalar more), the sum of the parts measured alone. The FLOPs count (once per run, after the first "
               f"loop, on the meta device; in the untimed loop here) took {c['flops_count_ms']:.1f} ms for this MLP "
               f"({c['flops_per_sample']:.0f} FLOPs per sample): a cost per run, "
               f"{c['flops_count_ms'] * 1e3 / r['rows'][0]['wall_us_per_step_min']:.0f} steps' time here.\n")]
    return lines


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    result = run(quick=args.quick)
    result["machine"] = (f"{_cpu()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                         f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    text = "\n".join(markdown_lines(result)) + f"\nMachine: {result['machine']}; OMP_NUM_THREADS=1.\n"
    print(text)
    write_results(args.out, text, result)


if __name__ == "__main__":
    main()
