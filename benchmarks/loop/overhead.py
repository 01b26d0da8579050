"""Loop overhead: the same tiny workload through a hand-written loop, cadence, Ignite and Lightning.

A 32-64-10 MLP, batch 16, SGD, ``STEPS`` steps over batches already in memory, one torch thread.
Contenders are interleaved and repeated; each timing is the training call alone (models and
data are built before the clock starts). Reported: microseconds per step (min and median over
the repeats) and the ratio of each to the raw loop measured in the same run: of the minimums, of
the medians, and paired (the median over the repeats of the ratio within each repeat, whose two
runs are seconds apart: the steadiest of the three on a shared machine, and the one the targets
are judged by).
"""

from __future__ import annotations

import importlib.util
import logging
import statistics
import tempfile
import time
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

STEPS = 2000
BATCH = 16
DEFAULT = "cadence (summaries + checkpoint every 500, async_save auto)"  # cadence's defaults, I/O on
TARGETS = {"cadence (summaries/checkpoints off)": 1.05, DEFAULT: 1.08}
"""Contender: the most its paired ratio to the raw loop may be."""


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def raw(batches) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    start = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def _cadence_task(batches):
    from cadence.torch import Task

    class BenchTask(Task):
        def build_model(self):
            return make_model()

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.01)

        def build_inputs(self, split, ctx):
            return batches

        def train_step(self, model, batch):
            x, y = batch
            return F.cross_entropy(model(x), y)

        def validation_step(self, model, batch):
            return {}

    return BenchTask()


def cadence(batches, *, with_io: bool = False, async_save: bool | str = False) -> float:
    from cadence import CheckpointManager, Controller
    from cadence.torch import Context, build_runners

    trainer, _ = build_runners(_cadence_task(batches), Context.create(device="cpu"), evaluate=False)
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(f"{tmp}/checkpoints", max_to_keep=2, async_save=async_save) if with_io else None
        controller = Controller(
            trainer=trainer, checkpoint_manager=manager, steps_per_loop=100,
            checkpoint_interval=500 if with_io else None, summary_dir=f"{tmp}/train" if with_io else None,
            progress=False,
        )
        start = time.perf_counter()
        controller.train(STEPS, checkpoint_at_completion=with_io)
        controller.close()  # an asynchronous final checkpoint is committed within the time
        elapsed = time.perf_counter() - start
    return elapsed


def ignite(batches) -> float:
    from ignite.engine import create_supervised_trainer

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = create_supervised_trainer(model, opt, F.cross_entropy)
    start = time.perf_counter()
    engine.run(batches, max_epochs=1)
    return time.perf_counter() - start


def lightning(batches) -> float:
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class OneLoader:  # a plain list would be taken as a list of dataloaders
        def __iter__(self):
            return iter(batches)

        def __len__(self):
            return len(batches)

    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=OneLoader())
    return time.perf_counter() - start


def contenders() -> dict[str, Callable]:
    found = {
        "raw loop": raw,
        "cadence (summaries/checkpoints off)": cadence,
        "cadence (summaries + checkpoint every 500)": lambda b: cadence(b, with_io=True),
        "cadence (summaries + async checkpoint every 500)": lambda b: cadence(b, with_io=True, async_save=True),
        DEFAULT: lambda b: cadence(b, with_io=True, async_save="auto"),
    }
    if importlib.util.find_spec("ignite"):
        found["ignite create_supervised_trainer"] = ignite
    if importlib.util.find_spec("pytorch_lightning"):
        found["lightning Trainer"] = lightning
    return found


def run(repeats: int = 15) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    batches = make_batches()
    runs = contenders()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up: imports, first-call costs
        fn(batches[:50] if name == "raw loop" else batches)
    for _ in range(repeats):
        for name, fn in runs.items():  # interleaved
            times[name].append(fn(batches))
    base_min, base_med = min(times["raw loop"]), statistics.median(times["raw loop"])
    rows = []
    for name, ts in times.items():
        rows.append({
            "contender": name,
            "us_per_step_min": min(ts) / STEPS * 1e6,
            "us_per_step_median": statistics.median(ts) / STEPS * 1e6,
            "ratio_min": min(ts) / base_min,
            "ratio_median": statistics.median(ts) / base_med,
            "ratio_paired": statistics.median(t / base for t, base in zip(ts, times["raw loop"])),
        })
    by_name = {row["contender"]: row for row in rows}
    targets = [{"contender": name, "bound": bound, "value": by_name[name]["ratio_paired"],
                "met": by_name[name]["ratio_paired"] <= bound} for name, bound in TARGETS.items()]
    return {"steps": STEPS, "batch": BATCH, "repeats": repeats, "rows": rows, "targets": targets,
            "target": "; ".join(f"{name} <= {bound:.2f}x the raw loop (paired)" for name, bound in TARGETS.items())}



def markdown_lines(r: dict) -> list[str]:
    """The table of :func:`run`'s result ``r``."""
    lines = [f"## Loop overhead ({r['steps']} steps, batch {r['batch']}, {r['repeats']} interleaved repeats)\n",
             "| contender | µs/step (min) | µs/step (median) | × raw (min) | × raw (median) | × raw (paired) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['contender']} | {row['us_per_step_min']:.1f} | {row['us_per_step_median']:.1f} | "
              f"{row['ratio_min']:.3f} | {row['ratio_median']:.3f} | "
              + (f"{row['ratio_paired']:.3f} |" if "ratio_paired" in row else "— |") for row in r["rows"]]
    if "targets" not in r:  # written before the paired ratio
        return [*lines, f"\nTarget: {r['target']}.\n"]
    verdicts = "; ".join(f"{t['contender']} {t['value']:.3f}x (<= {t['bound']:.2f}x: "
                         f"{'met' if t['met'] else '**missed**'})" for t in r["targets"])
    lines.append(f"\nPaired: the median over the repeats of each repeat's ratio. Targets (paired): {verdicts}.\n")
    return lines


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
