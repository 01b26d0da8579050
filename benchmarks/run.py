"""``make bench``: run every benchmark, write ``results/latest.json`` and ``results/latest.md``.

    python benchmarks/run.py [--only loop,checkpoint,sidecar,resume]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint_throughput  # noqa: E402
import loop_overhead  # noqa: E402
import resume_cost  # noqa: E402
import sidecar_latency  # noqa: E402

BENCHMARKS = {
    "loop": loop_overhead.run,
    "checkpoint": checkpoint_throughput.run,
    "async": checkpoint_throughput.async_stall,
    "sidecar": sidecar_latency.run,
    "resume": resume_cost.run,
}


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# cadence benchmarks\n", (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
                                        f"{m['date']}. Reproduce: `make bench`.\n")]
    if "loop" in results:
        r = results["loop"]
        lines += [f"## Loop overhead ({r['steps']} steps, batch {r['batch']}, {r['repeats']} interleaved repeats)\n",
                  "| contender | µs/step (min) | µs/step (median) | × raw (min) | × raw (median) |", "|---|---|---|---|---|"]
        lines += [f"| {row['contender']} | {row['us_per_step_min']:.1f} | {row['us_per_step_median']:.1f} | "
                  f"{row['ratio_min']:.3f} | {row['ratio_median']:.3f} |" for row in r["rows"]]
        lines.append(f"\nTarget: {r['target']}.\n")
    if "checkpoint" in results:
        r = results["checkpoint"]
        lines += [f"## Checkpoint throughput ({r['state_gib']:.2f} GiB model + Adam state, {r['repeats']} repeats)\n",
                  "| direction | raw s | cadence s | raw GiB/s | cadence GiB/s | cadence/raw throughput (median) | (best) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {row['direction']} | {row['raw_s_median']:.2f} | {row['cadence_s_median']:.2f} | "
                  f"{row['raw_gib_per_s']:.2f} | {row['cadence_gib_per_s']:.2f} | {row['throughput_ratio_median']:.2f} | "
                  f"{row['throughput_ratio_best']:.2f} |" for row in r["rows"]]
        lines.append(f"\nTarget: {r['target']}.\n")
        if "sha256_floor_s_median" in r:
            save = next(row for row in r["rows"] if row["direction"] == "save")
            lines.append(
                f"Floor: the raw save plus one SHA-256 pass over the same bytes takes {r['sha256_floor_s_median']:.2f} s "
                f"(raw/that = {r['sha256_floor_ratio']:.2f}): any save that hashes every byte on this machine is held "
                f"to about that ratio unless the hash runs beside the writes; cadence's save reaches "
                f"{save['throughput_ratio_median'] / r['sha256_floor_ratio']:.2f} of that floor.\n")
    if "async" in results:
        r = results["async"]
        first = ("first_async_stall_s" in r)
        lines += [f"## Async checkpointing: training stall per save ({r.get('saves', '?')} saves by one trainer)\n",
                  "| mode | stall s (median, saves 2+) | stall s (first save) |" if first else "| mode | stall s (median) |",
                  "|---|---|---|" if first else "|---|---|",
                  f"| synchronous | {r['sync_stall_s']:.3f} |" + (f" {r['first_sync_stall_s']:.3f} |" if first else ""),
                  f"| async | {r['async_stall_s']:.3f} |" + (f" {r['first_async_stall_s']:.3f} |" if first else ""),
                  f"\nAsync stall / sync stall: {r['ratio']:.3f}. Target: {r['target']}.\n"]
    if "sidecar" in results:
        r = results["sidecar"]
        lines += [(f"## Sidecar latency (commit → evaluation starts, {r['checkpoints']} checkpoints, "
                   f"poll {r['poll_interval_s']} s)\n"),
                  "| median s | p95 s | max s |", "|---|---|---|",
                  f"| {r['median_s']:.3f} | {r['p95_s']:.3f} | {r['max_s']:.3f} |", f"\nTarget: {r['target']}.\n"]
    if "resume" in results:
        r = results["resume"]
        lines += [f"## Resume cost ({r['samples']:,} samples, batch {r['batch']}, fresh process each)\n",
                  "| position | cadence: to first step s | cadence: seek s | replay: to first step s | replay: seek s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {row['position']:,} | {row['cadence_to_first_step_s']:.3f} | {row['cadence_seek_s']:.3f} | "
                  f"{row['replay_to_first_step_s']:.3f} | {row['replay_seek_s']:.3f} |" for row in r["rows"]]
        lines.append(f"\nTarget: {r['target']}.\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    args = parser.parse_args()
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    latest = out_dir / "latest.json"
    results: dict = json.loads(latest.read_text()) if latest.exists() else {}  # --only updates a part
    results["machine"] = machine()
    for name in args.only.split(","):
        print(f"running {name} ...", flush=True)
        start = time.time()
        results[name] = BENCHMARKS[name]()
        print(f"  done in {time.time() - start:.0f} s", flush=True)
    (out_dir / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "latest.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
