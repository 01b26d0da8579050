"""EMA overhead: the training loop keeping an EMA of the weights (``trainer.ema``, updated every step)
next to the same loop without one, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/loop/ema_overhead.py [--quick] [--out benchmarks/results/ema_overhead.md]

Two workloads through cadence's ``TorchTrainer`` (``build_runners``), one torch thread, CPU:

* ``mlp``: the loop benchmark's (``loop/overhead.py``: a 32-64-10 MLP, batch 16, SGD, batches in
  memory) -- the worst case: a step of ~100 µs, so a fixed per-step cost shows most;
* ``charlm``: the charlm example's transformer (``examples/charlm``: 2 layers, d_model 48, batch 32,
  AdamW), a step of a few ms.

Each run trains ``WARMUP`` untimed steps, then times ``steps`` steps (``trainer.train``); the two
contenders are interleaved, their order alternating, and repeated. Each timing is taken twice: the
process's CPU time (what the run costs, whatever else the machine runs) and wall time. Reported:
microseconds per step (min and median) and the ratio to the loop without an EMA. Target: <= 1.02x,
CPU time, of the medians. Also: the EMA's update alone (``ModelEMA.on_train_step_end``, ns per call) and
the memory it holds (bytes of the averaged copy next to the parameters'). ``benchmarks/run.py``
runs it as ``ema``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.loop import overhead as loop_overhead  # noqa: E402  (the loop benchmark's model and task)
from benchmarks.common.results_file import quick_main  # noqa: E402

WARMUP = 20
FULL = {"mlp": {"steps": 2000, "repeats": 11}, "charlm": {"steps": 200, "repeats": 7}}
QUICK = {"mlp": {"steps": 100, "repeats": 1}, "charlm": {"steps": 10, "repeats": 1}}
TARGET = 1.02
DECAY = 0.999
CONTENDERS = ("no EMA", "EMA every step")


def mlp_task() -> Any:
    steps = WARMUP + max(FULL["mlp"]["steps"], QUICK["mlp"]["steps"])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(loop_overhead.BATCH, 32, generator=g), torch.randint(0, 10, (loop_overhead.BATCH,), generator=g))
               for _ in range(steps)]
    return loop_overhead._cadence_task(batches)


def charlm_task() -> Any:
    from benchmarks.common.example_tasks import example_task_class

    return example_task_class("charlm", "CharLMTask")()


WORKLOADS: dict[str, tuple[str, Callable[[], Any]]] = {
    "mlp": ("32-64-10 MLP, batch 16, SGD", mlp_task),
    "charlm": ("charlm transformer (2 layers, d_model 48), batch 32, AdamW", charlm_task),
}


def trainer_for(task: Any, ema: bool) -> Any:
    from cadence import Controller
    from cadence.torch import Context, build_runners
    from cadence.config.components.ema import EMAConfig

    torch.manual_seed(0)
    trainer, _ = build_runners(task, Context.create(device="cpu"), evaluate=False,
                               ema=EMAConfig(decay=DECAY) if ema else None)
    trainer.initialize()
    # the EMA is a per-step callback: a controller hands it to the trainer (nothing per step without it)
    Controller(trainer, callbacks=[trainer.ema] if ema else [], steps_per_loop=1, restore=False, progress=False)
    return trainer


def timed_run(task: Any, steps: int, ema: bool) -> tuple[float, float]:
    """Train ``WARMUP`` steps untimed, then ``steps`` timed: ``(cpu_seconds, wall_seconds)``."""
    trainer = trainer_for(task, ema)
    trainer.train(WARMUP)
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.train(steps)
    return time.process_time() - cpu, time.perf_counter() - wall


def update_ns(task: Any, calls: int, repeats: int = 5) -> float:
    """Nanoseconds per ``ModelEMA.on_train_step_end`` (one foreach lerp over the model's float state), min over
    repeats."""
    ema = trainer_for(task, ema=True).ema
    step_end, steps = ema.on_train_step_end, range(1, calls + 1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for step in steps:
            step_end(None, step)  # the EMA needs no run
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e9


def memory(task: Any) -> dict[str, int]:
    trainer = trainer_for(task, ema=True)
    averaged = {id(t): t for t in trainer.ema.averaged_state().values() if t.is_floating_point()}
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
            "ema_bytes": sum(t.numel() * t.element_size() for t in averaged.values())}


def run_workload(name: str, steps: int, repeats: int, quick: bool) -> dict:
    label, build = WORKLOADS[name]
    task = build()
    times: dict[str, dict[str, list[float]]] = {c: {"cpu": [], "wall": []} for c in CONTENDERS}
    for contender in CONTENDERS:  # warm-up: first-call costs
        timed_run(task, min(steps, 20), contender != "no EMA")
    for i in range(repeats):
        for contender in CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]:  # interleaved, the order alternating
            cpu, wall = timed_run(task, steps, contender != "no EMA")
            times[contender]["cpu"].append(cpu)
            times[contender]["wall"].append(wall)
    base = times["no EMA"]
    rows = []
    for contender, kinds in times.items():
        row: dict = {"contender": contender}
        for kind, ts in kinds.items():
            row[f"{kind}_us_per_step_min"] = min(ts) / steps * 1e6
            row[f"{kind}_us_per_step_median"] = statistics.median(ts) / steps * 1e6
            row[f"{kind}_ratio_min"] = min(ts) / min(base[kind])
            row[f"{kind}_ratio_median"] = statistics.median(ts) / statistics.median(base[kind])
        rows.append(row)
    ratio = rows[1]["cpu_ratio_median"]
    return {"workload": name, "label": label, "steps": steps, "repeats": repeats, "rows": rows,
            "update_ns": update_ns(task, 200 if quick else 5000), **memory(task),
            "target": {"name": "EMA every step / no EMA (CPU time, medians)", "bound": TARGET, "value": ratio,
                       "met": ratio <= TARGET}}


def run(quick: bool = False) -> dict:
    settings = QUICK if quick else FULL
    torch.set_num_threads(1)
    return {"warmup_steps": WARMUP, "decay": DECAY, "quick": quick,
            "workloads": [run_workload(name, s["steps"], s["repeats"], quick) for name, s in settings.items()]}


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## EMA overhead (EMA of the weights updated every step, decay {r['decay']}, vs. none; "
              f"{r['warmup_steps']} untimed steps first, interleaved repeats{', quick' if r.get('quick') else ''})\n"),
             "| workload | contender | CPU µs/step (min / median) | × no EMA, CPU (min / median) | "
             "wall µs/step (min / median) | × no EMA, wall (min / median) |", "|---|---|---|---|---|---|"]
    for w in r["workloads"]:
        for row in w["rows"]:
            cells = [f"{row[f'{k}_us_per_step_min']:.1f} / {row[f'{k}_us_per_step_median']:.1f} | "
                     f"{row[f'{k}_ratio_min']:.3f} / {row[f'{k}_ratio_median']:.3f}" for k in ("cpu", "wall")]
            lines.append(f"| {w['workload']} ({w['steps']} steps × {w['repeats']}) | {row['contender']} | "
                         f"{cells[0]} | {cells[1]} |")
    lines.append("\nCPU time: the process's, all threads. Workloads: "
                 + "; ".join(f"{w['workload']}: {w['label']}" for w in r["workloads"]) + ".\n")
    for w in r["workloads"]:
        t = w["target"]
        base = w["rows"][0]["cpu_us_per_step_median"]
        lines.append(f"- {w['workload']}: {t['name']} {t['value']:.3f}x (<= {t['bound']:.2f}x: "
                     f"{'met' if t['met'] else '**missed**'}); the update alone {w['update_ns'] / 1e3:.1f} µs per "
                     f"step ({w['update_ns'] / 1e3 / base:.1%} of a step without an EMA); memory: "
                     f"{w['ema_bytes'] / 2**10:.1f} KiB averaged next to {w['parameter_bytes'] / 2**10:.1f} KiB of "
                     f"parameters.")
    lines.append("")
    return lines


def main() -> None:
    quick_main(__doc__, "EMA overhead", "loop/ema_overhead.py", run, markdown_lines)


if __name__ == "__main__":
    main()
