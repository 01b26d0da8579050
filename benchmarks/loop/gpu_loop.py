"""The loop on GPT-2 small on a GPU: cadence against a hand-written loop of the same steps, eager and compiled.

    python benchmarks/loop/gpu_loop.py [--device cuda] [--out benchmarks/results/gpu_loop.md]   (in make bench-gpu)
    python benchmarks/loop/gpu_loop.py --quick --device cpu   (a smoke test: a tiny GPT-2, aot_eager)

The workload: transformers' ``GPT2LMHeadModel(GPT2Config())`` (124 M parameters, built from the config:
nothing is downloaded), bf16 autocast, AdamW (fused on CUDA), one fixed batch of ``BATCH`` x ``SEQ``
tokens already on the device, GPT-2's own loss (labels: the inputs). Two contenders run exactly the
same ops, each with ``torch.compile`` off and on (inductor, default mode):

* **hand-written**: per step ``zero_grad(set_to_none=True)``; under autocast ``model(...).loss``;
  ``backward()``; ``optimizer.step()``; compiled with ``model.compile()``;
* **cadence**: the same model, optimizer and step as a Task, through ``build_runners(precision="bf16",
  compile_config=...)`` and a :class:`~cadence.Controller` with no checkpoints, summaries or
  evaluations, one inner loop per timed window (one host sync per window, as the hand-written loop's one
  ``synchronize``).

Each contender is built once per setting (the same seed: the same initial weights) and runs ``WARMUP``
steps (the compile, the allocator, AdamW's state); then they alternate timed windows of ``STEPS`` steps
(ABAB..., ``REPEATS`` each), each window between two ``torch.cuda.synchronize()``. Reported: ms per
step and steps/s (medians), MFU (the FLOPs of a step counted by cadence's own counter,
``count_flops_per_sample``, over the bf16 peak of cadence's device table), and the **paired ratio**:
the median over the repeats of cadence's window time over the hand-written window next to it.
Target (issue 40): <= 1.01x, eager and compiled. Both contenders' first losses are recorded: the same
ops on the same inputs give the same number.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.common.results_file import run_on_this_machine, write_results  # noqa: E402

BATCH, SEQ = 8, 1024
WARMUP, STEPS, REPEATS = 10, 100, 5
QUICK: dict[str, Any] = {"config": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 32,
                                   "bos_token_id": 0, "eos_token_id": 0},
                         "batch": 2, "seq": 16, "warmup": 2, "steps": 3, "repeats": 2}
TARGET = 1.01
"""The most cadence's paired time ratio to the hand-written loop may be."""
CONTENDERS = ("hand-written", "cadence")


class Workload:
    """GPT-2 (``quick``: a tiny one), its AdamW and one fixed batch of tokens on ``device``."""

    def __init__(self, device: str, quick: bool) -> None:
        from transformers import GPT2Config

        self.device = torch.device(device)
        self.config = GPT2Config(**QUICK["config"]) if quick else GPT2Config()
        batch, seq = (QUICK["batch"], QUICK["seq"]) if quick else (BATCH, SEQ)
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, self.config.vocab_size, (batch, seq), generator=g).to(self.device)

    def model(self) -> torch.nn.Module:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(0)  # both contenders start from the same weights
        return GPT2LMHeadModel(self.config)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=self.device.type == "cuda")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def step_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The step's loss: GPT-2's own next-token loss on ``tokens``."""
    return model(input_ids=tokens, labels=tokens).loss


class HandWritten:
    """The loop one writes by hand: the same ops as cadence's, nothing else."""

    def __init__(self, work: Workload, backend: str | None) -> None:
        self.work = work
        self.model = work.model().to(work.device)
        if backend is not None:
            self.model.compile(backend=backend)
        self.optimizer = work.optimizer(self.model)
        self.steps = 0

    def first_loss(self) -> float:
        """Step 1's loss."""
        return self.train(1)[0].item()

    def train(self, n: int) -> torch.Tensor:
        """``n`` steps; the losses, detached (no host sync)."""
        model, optimizer, tokens, device_type = self.model, self.optimizer, self.work.tokens, self.work.device.type
        model.train()
        losses = []
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = step_loss(model, tokens)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        self.steps += n
        return torch.stack(losses)


class Cadence:
    """The same steps as a Task through cadence's trainer and controller (no checkpoints, summaries, evals)."""

    def __init__(self, work: Workload, backend: str | None, steps_per_loop: int, total_steps: int) -> None:
        from cadence import Controller
        from cadence.config.schema import CompileConfig
        from cadence.torch import Context, Task, build_runners

        class GPT2Task(Task):
            def build_model(self) -> torch.nn.Module:
                return work.model()

            def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
                return work.optimizer(model)

            def build_inputs(self, split: str, ctx: Any) -> list[torch.Tensor]:
                return [work.tokens] * total_steps  # one epoch: no epoch boundary inside a window

            def train_step(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
                return step_loss(model, batch)

            def validation_step(self, model: torch.nn.Module, batch: torch.Tensor) -> dict:
                return {}

        self.task = GPT2Task()
        compile_config = None if backend is None else CompileConfig(backend=backend)
        self.trainer, _ = build_runners(self.task, Context.create(device=str(work.device)), precision="bf16",
                                        evaluate=False, compile_config=compile_config)
        # One inner loop per timed window; constructing it initializes the trainer (a fresh start).
        self.controller = Controller(trainer=self.trainer, steps_per_loop=steps_per_loop, progress=False)

    @property
    def steps(self) -> int:
        return self.trainer.global_step

    def first_loss(self) -> float:
        """Step 1 through the trainer's loop, the one the controller runs (its logged loss of one step)."""
        return self.trainer.train(1)["loss"]

    def train(self, n: int) -> None:
        """``n`` more steps through the controller."""
        self.controller.train(self.steps + n, checkpoint_at_completion=False)


def flops_per_step(work: Workload, task: Any) -> float:
    """The training FLOPs of one step, by cadence's counter (on the meta device)."""
    from cadence.torch.components.throughput import count_flops_per_sample

    return count_flops_per_sample(task, work.tokens.cpu()) * work.tokens.shape[0]


def peak_flops(work: Workload) -> float | None:
    """The device's bf16 peak FLOP/s from cadence's table (``None`` off CUDA or for a chip it lacks)."""
    from cadence.torch.components.device_peaks import peak_flops as table_peak

    return table_peak(torch.cuda.get_device_name(work.device), "bf16") if work.device.type == "cuda" else None


def measure(work: Workload, backend: str | None, warmup: int, steps: int, repeats: int) -> dict[str, Any]:
    """One setting (``backend``: None is eager): both contenders warmed up, then ABAB timed windows."""
    hand, cad = HandWritten(work, backend), Cadence(work, backend, steps, total_steps=warmup + steps * repeats + 1)
    first = {}
    for name, contender in (("hand-written", hand), ("cadence", cad)):
        torch.manual_seed(1)  # GPT-2's dropout draws the same masks in both
        first[name] = contender.first_loss()
    hand.train(warmup - 1)
    cad.train(warmup - 1)
    flops = flops_per_step(work, cad.task)
    runs: dict[str, Callable[[int], object]] = {"hand-written": hand.train, "cadence": cad.train}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(repeats):
        for name in CONTENDERS:  # alternated: A B A B ...
            work.synchronize()
            start = time.perf_counter()
            runs[name](steps)
            work.synchronize()
            times[name].append(time.perf_counter() - start)
    counted = {"hand-written": hand.steps, "cadence": cad.steps}
    del hand, cad, runs
    gc.collect()
    if work.device.type == "cuda":
        torch.cuda.empty_cache()
    peak = peak_flops(work)
    rows = []
    for name in CONTENDERS:
        step_s = statistics.median(times[name]) / steps
        rows.append({"contender": name, "ms_per_step_median": step_s * 1e3, "steps_per_s": 1 / step_s,
                     "mfu": flops / step_s / peak if peak else None, "steps": counted[name], "first_loss": first[name]})
    ratio = statistics.median(c / h for c, h in zip(times["cadence"], times["hand-written"]))
    return {"compile": backend, "rows": rows, "ratio_paired": ratio, "flops_per_step": flops, "peak_flops": peak,
            "target": {"bound": TARGET, "value": ratio, "met": ratio <= TARGET}}


def run(device: str = "cuda", quick: bool = False) -> dict[str, Any]:
    """Both settings, eager then compiled (``quick``: a tiny GPT-2, few steps, compiled with aot_eager)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_loop: no CUDA device here; `--quick --device cpu` is the smoke test")
    work = Workload(device, quick)
    warmup, steps, repeats = (QUICK["warmup"], QUICK["steps"], QUICK["repeats"]) if quick else (WARMUP, STEPS, REPEATS)
    backend = "aot_eager" if quick else "inductor"
    c = work.config
    return {"device": torch.cuda.get_device_name(work.device) if work.device.type == "cuda" else device,
            "quick": quick, "model": {"n_layer": c.n_layer, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
                                      "parameters": sum(p.numel() for p in work.model().parameters())},
            "batch": list(work.tokens.shape), "warmup": warmup, "steps": steps, "repeats": repeats,
            "settings": [measure(work, b, warmup, steps, repeats) for b in (None, backend)]}


def markdown_lines(r: dict[str, Any]) -> list[str]:
    """The table of :func:`run`'s result ``r``."""
    m = r["model"]
    lines = [f"## The loop on GPT-2 on {r['device']}: cadence against a hand-written loop\n",
             f"GPT-2 ({m['n_layer']} layers, d_model {m['n_embd']}; {m['parameters'] / 1e6:.1f} M parameters), bf16 "
             f"autocast, AdamW, batch {r['batch'][0]} x {r['batch'][1]} tokens; {r['warmup']} warm-up steps, then "
             f"{r['repeats']} alternated windows of {r['steps']} steps per contender.\n",
             "| torch.compile | contender | ms/step (median) | steps/s | MFU | × hand-written (paired) |",
             "|---|---|---|---|---|---|"]
    for s in r["settings"]:
        for row in s["rows"]:
            mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "—"
            ratio = f"{s['ratio_paired']:.3f}" if row["contender"] == "cadence" else "1"
            lines.append(f"| {s['compile'] or 'off'} | {row['contender']} | {row['ms_per_step_median']:.2f} | "
                         f"{row['steps_per_s']:.1f} | {mfu} | {ratio} |")
    verdicts = "; ".join(f"{s['compile'] or 'eager'} {s['target']['value']:.3f}x "
                         f"({'met' if s['target']['met'] else '**missed**'})" for s in r["settings"])
    lines.append(f"\nPaired: the median over the windows of cadence's time over the hand-written window next to "
                 f"it. Target <= {TARGET:.2f}x: {verdicts}.\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, a few steps, aot_eager (smoke test)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    text, result = run_on_this_machine("the loop on GPT-2 small", "loop/gpu_loop.py",
                                       lambda: run(args.device, quick=args.quick), markdown_lines)
    write_results(args.out, text, result)
    print(text)


if __name__ == "__main__":
    main()
