"""Step time on a device mesh (``trainer.parallel``), CPU and gloo: the llama_tp example's model on
1 process, tensor parallel over 2 ranks (tp 2) and data parallel over 2 ranks (dp 2: FSDP2 and DDP),
in one run, as ratios to 1 process.

    OMP_NUM_THREADS=1 python benchmarks/loop/mesh_step_time.py [--quick] [--out benchmarks/results/mesh_step_time.md]

One torchrun launch of 2 ranks (``mesh_step_time_worker.py``) builds a trainer for every layout with
cadence's ``attach_mesh`` + ``build_runners`` (as ``cadence train`` does), trains each ``WARMUP``
untimed steps, then ``repeats`` rounds of ``steps`` steps each, the layouts interleaved and their order
alternating, each block between two barriers of both ranks. Reported: rank 0's wall-clock and CPU
milliseconds per step (min and median over the rounds) and the ratio of the medians to 1 process.

The global batch is the same in every layout (16 rows of 32 characters): tp 2 splits each matmul's
width, dp 2 the rows. On CPU with gloo, with a model this small (75 k parameters), the ratios are the
cost of the collectives (TP's all-reduces in every layer, forward and backward; FSDP2's all-gathers and
reduce-scatters; DDP's gradient all-reduce), not a speed-up: the ranks share the machine's cores,
and a step of one process is a few ms. ``benchmarks/run.py`` runs it as ``mesh``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.common.results_file import quick_main  # noqa: E402

WORKER = Path(__file__).resolve().parent / "mesh_step_time_worker.py"
WARMUP = 5
FULL = {"steps": 20, "repeats": 9}
QUICK = {"steps": 2, "repeats": 1}
BASE = "1 process"


def launch(steps: int, repeats: int, warmup: int, quiet: bool = True) -> dict:
    """The worker's measurements (one torchrun launch of 2 ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               "--out", out, "--steps", str(steps), "--repeats", str(repeats), "--warmup", str(warmup)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                              stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
        if proc.returncode != 0:
            raise RuntimeError(f"the mesh benchmark failed (exit {proc.returncode}): {(proc.stdout or '')[-4000:]}")
        return json.loads(Path(out).read_text())


def run(quick: bool = False) -> dict:
    settings = QUICK if quick else FULL
    steps, repeats = settings["steps"], settings["repeats"]
    measured = launch(steps, repeats, 1 if quick else WARMUP)
    times, rows = measured["times"], []
    base = {kind: statistics.median(times[BASE][kind]) for kind in ("wall", "cpu")}
    for layout, kinds in times.items():
        row: dict = {"layout": layout, "ranks": 1 if layout == BASE else 2,
                     "local_parameters": measured["local_parameters"][layout]}
        for kind, ts in kinds.items():
            row[f"{kind}_ms_per_step_min"] = min(ts) / steps * 1e3
            row[f"{kind}_ms_per_step_median"] = statistics.median(ts) / steps * 1e3
            row[f"{kind}_ratio_median"] = statistics.median(ts) / base[kind]
        rows.append(row)
    return {"model": "examples/llama_tp LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 kv heads, MLP 128, "
                     "vocab 13, tied embeddings), global batch 16 x 32, AdamW",
            "steps": steps, "repeats": repeats, "warmup_steps": 1 if quick else WARMUP, "quick": quick, "rows": rows}


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## Step time on a device mesh, CPU and gloo ({r['steps']} steps × {r['repeats']} interleaved "
              f"rounds after {r['warmup_steps']} untimed{', quick' if r.get('quick') else ''})\n"),
             "| layout | ranks | rank 0's parameters | wall ms/step (min / median) | × 1 process, wall | "
             "rank 0's CPU ms/step (min / median) | × 1 process, CPU |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['layout']} | {row['ranks']} | {row['local_parameters']:,} | "
                     f"{row['wall_ms_per_step_min']:.2f} / {row['wall_ms_per_step_median']:.2f} | "
                     f"{row['wall_ratio_median']:.2f}× | {row['cpu_ms_per_step_min']:.2f} / "
                     f"{row['cpu_ms_per_step_median']:.2f} | {row['cpu_ratio_median']:.2f}× |")
    lines.append(f"\nModel: {r['model']}; the same global batch in every layout. On CPU with gloo these ratios are "
                 "the cost of the collectives (TP's all-reduces in every layer, FSDP2's all-gathers and "
                 "reduce-scatters, DDP's gradient all-reduce) on a model whose step takes a few ms, with the "
                 "ranks sharing the machine's cores: not a speed-up. Not measured on a GPU.\n")
    return lines


def main() -> None:
    quick_main(__doc__, "step time on a device mesh", "loop/mesh_step_time.py", run, markdown_lines)


if __name__ == "__main__":
    main()
