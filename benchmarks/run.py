"""``make bench``: run every benchmark, write ``results/latest.json`` and ``results/latest.md``.

    python benchmarks/run.py [--only loop,checkpoint,sharded,sidecar,resume,goodput,profiler,throughput,ema,compile] [--quick]

``--only`` updates those entries of ``latest.json`` and keeps the others. ``--quick`` runs the
benchmarks that have a quick mode (the checkpoint one: two tiny sizes, one repeat, every load
checked; the sharded one: a 6 MiB state on 1, 2 and 3 ranks; goodput: 150 steps with and without
kills) as a smoke test in about two minutes,
and writes ``results/quick.json`` and ``results/quick.md`` instead, so ``latest`` keeps the real
measurements. A full run of ``sharded`` also writes its own ``results/sharded_checkpoint.*``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint_throughput  # noqa: E402
import compile_speed  # noqa: E402
import ema_overhead  # noqa: E402
import goodput  # noqa: E402
import loop_overhead  # noqa: E402
import profiler_overhead  # noqa: E402
import resume_cost  # noqa: E402
import sharded_checkpoint  # noqa: E402
import sidecar_latency  # noqa: E402
import throughput_overhead  # noqa: E402

BENCHMARKS = {
    "loop": loop_overhead.run,
    "checkpoint": checkpoint_throughput.run,  # includes the asynchronous save (the former "async" entry)
    "sharded": sharded_checkpoint.run,
    "sidecar": sidecar_latency.run,
    "resume": resume_cost.run,
    "goodput": goodput.run,  # 2 ranks killed every N s vs. no faults (--quick: 150 steps)
    "compile": compile_speed.run,  # charlm eager vs. trainer.compile (inductor, CPU); --quick: aot_eager
    "profiler": profiler_overhead.run,  # the loop with the profiler outside its window vs. none
    "throughput": throughput_overhead.run,  # the loop logging samples/s, tokens/s, MFU vs. not
    "ema": ema_overhead.run,  # the loop keeping an EMA of the weights (every step) vs. not
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


def markdown(results: dict, reproduce: str = "make bench") -> str:
    m = results["machine"]
    lines = ["# cadence benchmarks\n", (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
                                        f"{m['date']}. Reproduce: `{reproduce}`.\n")]
    if "loop" in results:
        r = results["loop"]
        lines += [f"## Loop overhead ({r['steps']} steps, batch {r['batch']}, {r['repeats']} interleaved repeats)\n",
                  "| contender | µs/step (min) | µs/step (median) | × raw (min) | × raw (median) |", "|---|---|---|---|---|"]
        lines += [f"| {row['contender']} | {row['us_per_step_min']:.1f} | {row['us_per_step_median']:.1f} | "
                  f"{row['ratio_min']:.3f} | {row['ratio_median']:.3f} |" for row in r["rows"]]
        lines.append(f"\nTarget: {r['target']}.\n")
    if "checkpoint" in results:
        lines += checkpoint_markdown(results["checkpoint"])
    if "sharded" in results:
        lines += sharded_markdown(results["sharded"])
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
    if "goodput" in results:
        lines += goodput.markdown_lines(results["goodput"])
    if "compile" in results:
        lines += compile_speed.markdown_lines(results["compile"])
    if "profiler" in results:
        lines += profiler_overhead.markdown_lines(results["profiler"])
    if "throughput" in results:
        lines += throughput_overhead.markdown_lines(results["throughput"])
    if "ema" in results:
        lines += ema_overhead.markdown_lines(results["ema"])
    return "\n".join(lines)


def _s(row: dict, kind: str) -> str:
    if f"{kind}_s_median" not in row:
        return "—"
    return f"{row[f'{kind}_s_median']:.2f} ({row[f'{kind}_s_min']:.2f})"


def _ratio(row: dict, kind: str) -> str:
    if f"{kind}_ratio_median" not in row:
        return "—"
    return f"{row[f'{kind}_ratio_median']:.2f} ({row[f'{kind}_ratio_min']:.2f})"


def _target(t: dict) -> str:
    if t["name"].endswith("fraction"):
        value = "n/a" if t["value"] is None else f"{t['value'] * 100:.1f}%"
        bound = f"{t['bound'] * 100:.0f}%"
    else:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}x"
        bound = f"{t['bound']:.2f}x"
    verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
    return f"{value} ({'<=' if t['at_most'] else '>='} {bound}: {verdict})"


TARGET_NAMES = {"save_vs_raw": "save vs raw", "save_vs_dcp": "save vs DCP", "load_vs_raw": "load vs raw",
                "load_vs_dcp": "load vs DCP", "async_stall_fraction": "async stall / sync save",
                "step_ratio_during_save": "step time during a background save"}


def checkpoint_markdown(r: dict) -> list[str]:
    if "sizes" not in r:  # written by an older version of this benchmark
        return ["## Checkpoint save and load\n", "(Old format: rerun `python benchmarks/run.py --only checkpoint`.)\n"]
    lines = []
    for size in r["sizes"]:
        a = size["async"]
        lines += [(f"## Checkpoint save and load, {size['label']} ({size['state_gib']:.2f} GiB: {size['layers']} layers of "
                   f"{size['width']}x{size['width']} float32 + Adam state; {size['repeats']} interleaved repeats"
                   f"{', quick' if r.get('quick') else ''})\n"),
                  "| contender | save s | save × raw | load s | load × raw |", "|---|---|---|---|---|"]
        lines += [f"| {row['contender']} | {_s(row, 'save')} | {_ratio(row, 'save')} | {_s(row, 'load')} | "
                  f"{_ratio(row, 'load')} |" for row in size["rows"]]
        lines += ["\nSeconds: median (min). × raw: raw time / contender time (> 1: faster than raw), of the medians "
                  "(of the minimums). Saves include the fsync of every file; loads go into the live model and "
                  "optimizer, from the files just written (page cache). † the optimizer state it loads maps the "
                  "file: its pages are read on first use, after the clock stops.\n",
                  (f"Asynchronous save ({a['saves']} saves by one trainer, training thread at "
                   f"{a['torch_threads']} torch thread(s)):\n"),
                  "| | stall s | / synchronous save |", "|---|---|---|",
                  f"| first save | {a['first_stall_s']:.3f} | {a['first_stall_fraction'] * 100:.1f}% |",
                  f"| saves 2+ (median) | {a['steady_stall_s']:.3f} | {a['steady_stall_fraction'] * 100:.1f}% |",
                  *([f"| floor: one copy of the state into allocated memory | {a['copy_floor_s']:.3f} | "
                     f"{a['copy_floor_fraction'] * 100:.1f}% |"] if "copy_floor_s" in a else []),
                  (f"\nSynchronous save (cadence, crc32c, median above): {a['sync_save_s']:.2f} s; background save "
                   f"(save() to committed, median): {a['background_save_s_median']:.2f} s."),
                  (f"Training step (three 1024x1024 layers, batch 64): {a['step_ms_idle']:.1f} ms without a save "
                   f"in flight ({a['steps_idle']} steps), "
                   + (f"{a['step_ms_during_save']:.1f} ms with one ({a['steps_during_save']} steps): "
                      f"{a['step_ratio_during_save']:.2f}x.\n" if a["step_ratio_during_save"] is not None
                      else "no step completed during a save.\n")),
                  "Targets, cadence (crc32c): " + "; ".join(f"{TARGET_NAMES[t['name']]} {_target(t)}"
                                                          for t in size["targets"]) + ".\n"]
    return lines


def _phases(phases: dict, names: tuple[str, ...]) -> str:
    return " / ".join("—" if phases.get(name) is None else f"{phases[name]:.2f}" for name in names)


def sharded_markdown(r: dict) -> list[str]:
    rows = r["rows"]
    sizes = sorted({f"{row['state_gib']:.2f}" for row in rows})
    lines = [(f"## Sharded checkpoint save and load under FSDP2 ({' / '.join(sizes)} GiB: {r['layers']} layers of "
              f"{r['width']}x{r['width']} float32 + AdamW state; torchrun ranks, gloo, CPU; {r['repeats']} alternating "
              f"repeats after a warm-up round{', quick' if r.get('quick') else ''})\n"),
             "| ranks | contender | written GiB | save s | write GiB/s | load s | read GiB/s |",
             "|---|---|---|---|---|---|---|"]
    names = {"dcp": "plain DCP (dcp.save / dcp.load)", "cadence": "cadence (CheckpointSession, crc32c)"}
    for row in rows:
        for key in ("dcp", "cadence"):
            c = row["contenders"][key]
            lines.append(f"| {row['world_size']} | {names[key]} | {c['bytes_written'] / 2**30:.2f} | "
                         f"{c['save_s_median']:.2f} ({c['save_s_min']:.2f}) | {c['write_gib_per_s']:.2f} | "
                         f"{c['load_s_median']:.2f} ({c['load_s_min']:.2f}) | {c['read_gib_per_s']:.2f} |")
    lines += ["\n| ranks | save: cadence / DCP | load: cadence / DCP | checksum share of cadence's save | "
              "verification share of cadence's load | cadence save: write_shards / DCP write / read-back checksum / "
              "commit s | cadence load: verify / DCP read s |",
              "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['world_size']} | {row['save_ratio']:.2f}x | {row['load_ratio']:.2f}x | "
                     f"{row['checksum_save_share'] * 100:.1f}% | {row['verify_load_share'] * 100:.1f}% | "
                     f"{_phases(row['phases']['save'], ('write_shards', 'dcp_write', 'checksum', 'commit'))} | "
                     f"{_phases(row['phases']['load'], ('verify', 'dcp_read'))} |")
    lines.append("\nSeconds: median (min), wall clock from a barrier of all ranks to one after. Write (read) GiB/s: "
                 "the bytes of every rank's files together / the median save (load). cadence / DCP: of the median "
                 "times (> 1: cadence is slower). Shares and phases: the slowest rank's seconds in the phase (median "
                 "over repeats), as a share of the wall time; the read-back checksum is inside write_shards, the DCP "
                 "write too; commit is the chief's. Saves fsync every file (both contenders); loads read the files "
                 "just written, from the page cache (not dropped: no root). On 1 rank the model is sharded over a "
                 "one-rank group (a cadence run on one process does not shard: it writes safetensors files, see the "
                 "checkpoint benchmark). The ranks share the machine's cores, OMP_NUM_THREADS=1.\n")
    return lines


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
        results[name] = fn(quick=True) if args.quick and name in quick_ones else fn()
        if name == "checkpoint":
            results.pop("async", None)  # now part of "checkpoint"
        if name == "sharded" and not args.quick:  # also in a file of its own
            sharded_checkpoint.write_results(results[name], markdown({"machine": results["machine"], name: results[name]}),
                                             out_dir / "sharded_checkpoint.md")
        print(f"  done in {time.time() - start:.0f} s", flush=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
