"""``make bench``: run every benchmark, write ``results/latest.json`` and ``results/latest.md``.

    python -m benchmarks.run [--quick]   (from the checkout; or python benchmarks/run.py)
        [--only loop,checkpoint,stall,crossover,sharded,sidecar,resume,goodput,goodput_nodes,replica_goodput,profiler,
         throughput,ema,compile,mesh]

``--only`` updates those entries of ``latest.json`` and keeps the others. ``--quick`` runs the
benchmarks that have a quick mode (the checkpoint one: two tiny sizes, one repeat, every load
checked; the stall one: a 6 MiB state and a tiny charlm, two saves each; the sharded one: a 6 MiB
state on 1, 2 and 3 ranks; goodput: 100 steps with and without kills; goodput_nodes: 40 steps on
two nodes, with and without a node lost; replica_goodput: 150 steps of 2 replica groups and of a 2-rank job, each
killed once; mesh: 2 steps of each layout) as a smoke test in a few minutes, and writes
``results/quick.json`` and ``results/quick.md`` instead, so ``latest`` keeps the real
measurements. A full run of ``sharded`` or ``replica_goodput`` also writes its own ``results/sharded_checkpoint.*``
or ``results/replica_goodput.*``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # (imports `benchmarks`: see its __init__)

HERE = Path(__file__).resolve().parent

from benchmarks.checkpoint import stall as checkpoint_stall  # noqa: E402
from benchmarks.checkpoint import throughput as checkpoint_throughput  # noqa: E402
from benchmarks.loop import compile_speed  # noqa: E402
from benchmarks.loop import ema_overhead  # noqa: E402
from benchmarks.loop import mesh_step_time  # noqa: E402
from benchmarks.faults import goodput  # noqa: E402
from benchmarks.faults import goodput_nodes  # noqa: E402
from benchmarks.faults import replica_goodput  # noqa: E402
from benchmarks.loop import overhead as loop_overhead  # noqa: E402
from benchmarks.loop import profiler_overhead  # noqa: E402
from benchmarks.checkpoint import resume_cost  # noqa: E402
from benchmarks.checkpoint import save_mode_crossover  # noqa: E402
from benchmarks.checkpoint import sharded as sharded_checkpoint  # noqa: E402
from benchmarks.sidecar import latency as sidecar_latency  # noqa: E402
from benchmarks.loop import throughput_overhead  # noqa: E402
from benchmarks.docs_tables import RENDERERS, regenerate  # noqa: E402
from benchmarks.common.results_file import header, machine, write_results  # noqa: E402

BENCHMARKS = {
    "loop": loop_overhead.run,
    "checkpoint": checkpoint_throughput.run,  # save and load, every contender (asynchronous saves: "stall")
    "stall": checkpoint_stall.run,  # the training thread's stall for an async save (pipelined, DCP's stager)
    "crossover": save_mode_crossover.run,  # where asynchronous saves start to pay (checkpoint.async_save: auto)
    "sharded": sharded_checkpoint.run,
    "sidecar": sidecar_latency.run,
    "resume": resume_cost.run,
    "goodput": goodput.run,  # 2 ranks killed every N s vs. no faults (--quick: 100 steps)
    "goodput_nodes": goodput_nodes.run,  # 2 nodes, node 1 lost every N s vs. no faults (--quick: once)
    "replica_goodput": replica_goodput.run,  # 2 replica groups vs. a 2-rank job, one killed every 30 s (--quick: once)
    "compile": compile_speed.run,  # charlm eager vs. trainer.compile (inductor, CPU); --quick: aot_eager
    "profiler": profiler_overhead.run,  # the loop with the profiler outside its window vs. none
    "throughput": throughput_overhead.run,  # the loop logging samples/s, tokens/s, MFU vs. not
    "ema": ema_overhead.run,  # the loop keeping an EMA of the weights (every step) vs. not
    "mesh": mesh_step_time.run,  # llama_tp's step on 1 process, tp 2, dp 2 (FSDP2, DDP): the collectives' cost
}


MARKDOWN = {name: RENDERERS[name] for name in BENCHMARKS}
"""Each benchmark's tables, in the order of the page."""


def markdown(results: dict, reproduce: str = "make bench") -> str:
    """The page of ``results`` (``machine`` and an entry per benchmark that ran)."""
    lines = header(results["machine"], reproduce)
    for name, lines_of in MARKDOWN.items():
        if name in results:
            lines += lines_of(results[name])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: the benchmarks with a quick mode, tiny; writes results/quick.*")
    args = parser.parse_args()
    quick_ones = [name for name, fn in BENCHMARKS.items() if "quick" in inspect.signature(fn).parameters]
    names = args.only.split(",") if args.only else (quick_ones if args.quick else list(BENCHMARKS))
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stem = "quick" if args.quick else "latest"
    previous = out_dir / f"{stem}.json"
    results: dict = json.loads(previous.read_text()) if previous.exists() and not args.quick else {}  # --only: a part
    results["machine"] = machine()
    for name in names:
        print(f"running {name} ...", flush=True)
        start = time.time()
        fn = BENCHMARKS[name]
        load = os.getloadavg()[0]
        results[name] = fn(quick=True) if args.quick and name in quick_ones else fn()
        results[name]["machine"] = {**machine(), "load_average_1min": [load, os.getloadavg()[0]]}
        if name == "checkpoint":
            results.pop("async", None)  # an entry of older runs, measured by "stall" now
        own = {"sharded": "sharded_checkpoint", "replica_goodput": "replica_goodput"}.get(name)
        if own and not args.quick:  # also in a file of its own
            write_results(out_dir / f"{own}.md", markdown({"machine": results["machine"], name: results[name]}),
                          results[name])
        print(f"  done in {time.time() - start:.0f} s", flush=True)
    write_results(out_dir / f"{stem}.md", markdown(results), results)
    print(markdown(results))
    if not args.quick:  # the README's and the performance page's tables
        for page in regenerate():
            print(f"regenerated the tables of {page}")


if __name__ == "__main__":
    main()
