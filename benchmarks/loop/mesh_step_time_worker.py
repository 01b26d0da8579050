"""Rank worker of ``benchmarks/loop/mesh_step_time.py`` (one launch of 2 ranks measures every layout)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/loop/mesh_step_time_worker.py --out RESULT.json --steps S --repeats R --warmup W

The model is the llama_tp example's (``examples/llama_tp``: ``LlamaTask`` with its defaults, a
global batch of 16 rows of 32 characters, AdamW). Each layout gets its own ``TorchTrainer``, built by
cadence's ``attach_mesh`` + ``build_runners`` as ``cadence train`` builds it:

- ``1 process``: rank 0 alone, without a process group (``Context(rank=0, world_size=1)``), the
  whole global batch; rank 1 waits at the barrier meanwhile;
- ``tp 2``: ``trainer.parallel {tp: 2}``, the example's plan (both ranks read the same 16 rows);
- ``dp 2 (FSDP2)``: ``{dp_shard: 2}``, ``fully_shard`` of the decoder layers and the root, 8 rows each;
- ``dp 2 (DDP)``: ``{dp_replicate: 2}``, DDP, 8 rows each.

Every trainer first trains ``W`` untimed steps. Then ``R`` rounds, the layouts' order alternating:
each layout trains ``S`` steps between two barriers of both ranks, timed on rank 0's wall clock and
CPU clock (its process's). Rank 0 writes the timings (seconds per block of ``S`` steps) and its
share of the parameters in each layout to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks`

LAYOUTS = {"1 process": None, "tp 2": {"tp": 2}, "dp 2 (FSDP2)": {"dp_shard": 2}, "dp 2 (DDP)": {"dp_replicate": 2}}
"""Each layout's ``trainer.parallel`` (None: one process, no mesh)."""


def trainer_for(parallel: dict | None, rank: int) -> object | None:
    """The layout's trainer (None on rank 1 for ``1 process``), initialised, seeded as a run is."""
    from benchmarks.common.example_tasks import example_task_class
    from cadence.config.components.parallel import ParallelConfig
    from cadence.torch import Context, build_runners
    from cadence.torch.experiments.runners import attach_mesh

    if parallel is None and rank != 0:
        return None
    torch.manual_seed(0)
    task = example_task_class("llama_tp", "LlamaTask")()
    if parallel is None:
        ctx, degrees = Context.create(device="cpu", rank=0, world_size=1), None
    else:
        ctx = Context.create(device="cpu")
        degrees = attach_mesh(task, ctx, ParallelConfig(**parallel))
    trainer, _ = build_runners(task, ctx, evaluate=False, degrees=degrees)
    trainer.initialize()
    return trainer


def timed(trainer: object | None, steps: int) -> tuple[float, float]:
    """``steps`` steps of ``trainer`` (nothing on a rank without one) between two barriers:
    ``(wall_s, cpu_s)`` of this process."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    if trainer is not None:
        trainer.train(steps)
    dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from cadence.torch import Context

    Context.create(device="cpu")  # torchrun's process group (gloo), as a run's first context starts it
    rank = dist.get_rank()
    trainers = {name: trainer_for(parallel, rank) for name, parallel in LAYOUTS.items()}
    for trainer in trainers.values():
        timed(trainer, args.warmup)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in LAYOUTS}
    names = list(LAYOUTS)
    for i in range(args.repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            wall, cpu = timed(trainers[name], args.steps)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
    if rank == 0:
        local = {name: sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in t.model.parameters())
                 for name, t in trainers.items() if t is not None}  # rank 0's share of the parameters
        Path(args.out).write_text(json.dumps({"times": times, "local_parameters": local}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
