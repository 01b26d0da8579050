"""``trainer.compile`` on CPU: the charlm example (examples/charlm, a 2-layer causal transformer,
d_model 48, batch 32 of 32 characters) trained eagerly and compiled with inductor, side by side.

    OMP_NUM_THREADS=1 python benchmarks/loop/compile_speed.py [--quick] [--out benchmarks/results/compile_speed.md]

Both run in one process, through cadence's own trainer (``build_runners(..., compile_config=...)``),
from the same initial weights on the same batches: the first training step of each (for the compiled
model: dynamo's trace, AOTAutograd, inductor generating and building the C++ kernels of the forward
and the backward, then the step), ``warmup`` more steps each, then ``windows`` timed windows of
``window`` steps, eager and compiled alternating (the ratio of each pair of windows; the machine's
noise hits both alike), then the first and a second evaluation of 4 validation batches of each (the
compiled model compiles its evaluation graph at its first). ``repeats`` such processes, each with an
empty inductor cache (a cold compile, as on a fresh machine); then one more process reuses the last
one's cache (warm: the kernels are not built again; dynamo still traces). CPU only (no GPU lent to
this machine): inductor's CPU kernels, one torch thread. ``benchmarks/run.py`` runs it as ``compile``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.common.results_file import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

FULL = {"backend": "inductor", "repeats": 2, "warmup": 20, "window": 50, "windows": 7}
QUICK = {"backend": "aot_eager", "repeats": 1, "warmup": 2, "window": 5, "windows": 2}
"""The quick mode (a smoke test) compiles with aot_eager: seconds, no C++ build."""

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from task import CharLMTask
from cadence.config.schema import CompileConfig
from cadence.torch import Context, build_runners
p = json.loads(sys.argv[2])
task = CharLMTask(validation_samples=512)
def runners(compile_config):
    torch.manual_seed(0)  # the same initial weights; the loaders draw the same batches (seeded by the context)
    trainer, evaluator = build_runners(task, Context(device="cpu", seed=0), compile_config=compile_config)
    trainer.initialize()
    return trainer, evaluator
def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
contenders = {"eager": runners(None), "compiled": runners(CompileConfig(backend=p["backend"]))}
out = {name: {} for name in contenders}
for name, (trainer, _) in contenders.items():
    out[name]["first_step_s"] = timed(lambda: trainer.train(1))
    if p["only_first_step"]:
        continue
    trainer.train(p["warmup"])
if not p["only_first_step"]:
    for name in contenders:
        out[name]["windows"] = []
    for _ in range(p["windows"]):
        for name, (trainer, _) in contenders.items():
            out[name]["windows"].append(p["window"] / timed(lambda: trainer.train(p["window"])))
    for name, (trainer, evaluator) in contenders.items():
        out[name]["steps_per_s"] = statistics.median(out[name]["windows"])
        out[name]["first_eval_s"] = timed(lambda: evaluator.evaluate(4))
        out[name]["second_eval_s"] = timed(lambda: evaluator.evaluate(4))
        out[name]["loss"] = trainer.train(1)["loss"]
print(json.dumps(out))
"""


def _process(p: dict, cache: str, *, only_first_step: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT / "src")}
    args = json.dumps({**p, "only_first_step": only_first_step})
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples" / "charlm"), args], capture_output=True,
                         text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the benchmark process failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not only_first_step:
        result["ratios"] = [c / e for c, e in zip(result["compiled"]["windows"], result["eager"]["windows"])]
    return result


def run(quick: bool = False, root: str | None = None) -> dict:
    """``repeats`` processes with a cold inductor cache, then, for inductor, one with a warm one (its first step
    only; aot_eager, the quick mode's backend, keeps no cache: ``warm_first_step`` and ``warm_compile_s`` are None)."""
    p = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(dir=root, prefix="cadence-compile-") as tmp:
        processes = [_process(p, str(Path(tmp, f"cache-{i}"))) for i in range(p["repeats"])]
        warm = (_process(p, str(Path(tmp, f"cache-{p['repeats'] - 1}")), only_first_step=True)
                if p["backend"] == "inductor" else None)
    ratios = [r for process in processes for r in process["ratios"]]
    first = {name: statistics.median(x[name]["first_step_s"] for x in processes) for name in ("eager", "compiled")}
    return {
        "quick": quick, **p, "model": "examples/charlm CharTransformer (d_model 48, 2 layers, 4 heads, ff 96)",
        "batch": 32, "seq_len": 32, "device": "cpu", "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "processes": processes, "warm_first_step": warm,
        "eager_steps_per_s": statistics.median(x["eager"]["steps_per_s"] for x in processes),
        "compiled_steps_per_s": statistics.median(x["compiled"]["steps_per_s"] for x in processes),
        "speedup": statistics.median(ratios),  # compiled / eager steps/s, window by window; > 1: compiled is faster
        "speedup_min": min(ratios), "speedup_max": max(ratios),
        "cold_compile_s": first["compiled"] - first["eager"],
        "warm_compile_s": None if warm is None else warm["compiled"]["first_step_s"] - warm["eager"]["first_step_s"],
        "eval_compile_s": statistics.median(x["compiled"]["first_eval_s"] - x["compiled"]["second_eval_s"]
                                            for x in processes),
    }


def markdown_lines(r: dict) -> list[str]:
    backend = r["backend"]
    lines = [(f"## torch.compile on CPU (`trainer.compile`, {backend}): {r['model']}, batch {r['batch']} x "
              f"{r['seq_len']}, {r['torch_threads']} torch thread(s), eager and compiled in one process, "
              f"{r['repeats']} process(es){', quick' if r.get('quick') else ''}\n"),
             "| process | contender | first step s | steps/s | first eval s | second eval s | loss after |",
             "|---|---|---|---|---|---|---|"]
    for i, process in enumerate(r["processes"], 1):
        for name, label in (("eager", "eager"), ("compiled", f"{backend}, cold cache")):
            x = process[name]
            lines.append(f"| {i} | {label} | {x['first_step_s']:.2f} | {x['steps_per_s']:.1f} | {x['first_eval_s']:.2f} | "
                         f"{x['second_eval_s']:.3f} | {x['loss']:.4f} |")
    w = r["warm_first_step"]
    if w is not None:
        lines.append(f"| {len(r['processes']) + 1} | eager / {backend}, warm cache | {w['eager']['first_step_s']:.2f} / "
                     f"{w['compiled']['first_step_s']:.2f} | | | | |")
    warm = "" if r["warm_compile_s"] is None else f", {r['warm_compile_s']:.1f} s warm"
    lines.append(
        f"\nSteps/s: the median of {r['windows']} windows of {r['window']} steps after {r['warmup'] + 1} steps, eager "
        f"and compiled windows alternating. Compiled / eager steps/s, window by window: **{r['speedup']:.2f}x** "
        f"(median; {r['speedup_min']:.2f}x to {r['speedup_max']:.2f}x). Compile time, the first step less eager's: "
        f"**{r['cold_compile_s']:.1f} s** with a cold cache{warm}; the first "
        f"evaluation compiles its own graph: {r['eval_compile_s']:.1f} s more than the second. CPU only: no GPU on "
        "this machine, where inductor's generated kernels pay most.\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run with aot_eager (smoke test)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    result = run(quick=args.quick)
    text = "\n".join(markdown_lines(result))
    print(text)
    write_results(args.out, text, result)


if __name__ == "__main__":
    main()
