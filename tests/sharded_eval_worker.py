"""One rank of the sharded-evaluation tests (tests/processes/test_torch_sharded_eval.py), started with spawn.

Each rank joins a gloo group (file:// rendezvous: no port to pick), evaluates its strided,
unpadded shard of a 1001-sample validation set with a real ``TorchCoordinator``, and pickles
what every scenario returned (or the error it raised) to ``<out_dir>/rank<r>.pkl``.
"""

from __future__ import annotations

import datetime
import gc
import pickle
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from cadence.metrics import Concat, FunctionReducer, Max, Mean, Min, Sum
from cadence.torch import Context, Task, TorchEvaluator
from cadence.torch.runtime.distributed import TorchCoordinator

try:
    import torchmetrics
except ImportError:  # optional: the torchmetrics checks are skipped without it
    torchmetrics = None

N = 1001
BATCH = 64


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    noise = torch.randn(N, generator=g, dtype=torch.float64)
    y = (x[:, 0] + x[:, 1] + noise > 0).long()
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(8, 1).double()  # float64 end to end: per-sample scores do not depend on batching


def shard(dataset: Any, rank: int, world_size: int) -> Subset:
    """Strided and unpadded, like ``ctx.wrap_dataset``: rank r gets r, r + W, r + 2W, ..."""
    return Subset(dataset, range(rank, len(dataset), world_size))


def auc_of_pairs(values: list) -> float:
    scores = np.concatenate([s for s, _ in values])
    labels = np.concatenate([y for _, y in values])
    return roc_auc_score(labels, scores)


class ShardedTask(Task):
    def build_model(self):
        return make_model()

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_inputs(self, split, ctx):
        return DataLoader(shard(make_data(), ctx.rank, ctx.world_size), batch_size=BATCH)

    def train_step(self, model, batch):
        raise NotImplementedError

    def build_metrics(self):
        metrics = {
            "acc_mean": Mean(),
            "acc_per_sample": Mean(),
            "auc": Concat(fn=lambda s, y: roc_auc_score(y, s)),
            "auc_fn": FunctionReducer(auc_of_pairs),
            "auc_plain_fn": auc_of_pairs,  # a plain function: buffered like FunctionReducer
            "max_score": Max(),
            "min_score": Min(),
            "positives": Sum(),
        }
        if torchmetrics is not None:
            from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

            metrics["tm_auroc"] = BinaryAUROC()
            metrics["tm_accuracy"] = BinaryAccuracy()
        return metrics

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x).squeeze(1)
        scores = torch.sigmoid(logits)
        correct = (scores > 0.5).long() == y
        return {
            "accuracy": correct.double().mean(),  # a plain scalar: batch-size-weighted mean
            "loss": F.binary_cross_entropy_with_logits(logits, y.double()),
            "acc_mean": (correct.sum(), len(y)),  # Mean's (value_sum, weight)
            "acc_per_sample": correct,
            "auc": (scores, y),
            "auc_fn": (scores, y),
            "auc_plain_fn": (scores, y),
            "max_score": scores,
            "min_score": scores,
            "positives": y,
            "tm_auroc": (scores, y),
            "tm_accuracy": (scores, y),
            "logits": logits,  # not a scalar: not in the result
        }


class Aggregating(ShardedTask):
    """TF Model Garden style: aggregate_logs / reduce_aggregated_logs, without a cross-rank merge."""

    def build_metrics(self):
        return {}

    def aggregate_logs(self, state, step_outputs):
        return (state or []) + [step_outputs["max_score"]]

    def reduce_aggregated_logs(self, aggregated_logs, global_step):
        values = torch.cat(aggregated_logs)
        return {"median": values.median(), "count": len(values)}


class Merging(Aggregating):
    def merge_aggregated_logs(self, states):
        return [t for state in states for t in state]


HEAD = 301
"""The samples of the "head" split of :class:`NamedSplits` (uneven on 2 and 3 ranks too)."""


class NamedSplits(Merging):
    """Validation in two named splits, ``{"all": the whole set, "head": its first HEAD samples}``:
    reducers, batch-weighted means and merged aggregate_logs, per split."""

    def build_metrics(self):
        return ShardedTask.build_metrics(self)

    def build_inputs(self, split, ctx):
        data = make_data()
        return {"all": DataLoader(shard(data, ctx.rank, ctx.world_size), batch_size=BATCH),
                "head": DataLoader(shard(Subset(data, range(HEAD)), ctx.rank, ctx.world_size), batch_size=BATCH)}


class FailingOnRank1(ShardedTask):
    def validation_step(self, model, batch):
        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        return super().validation_step(model, batch)


def _evaluate(task: Task, ctx: Context, num_steps: int = -1) -> dict[str, Any]:
    model = task.build_model()
    return TorchEvaluator(task, model, ctx=ctx).evaluate(num_steps)


def scenarios(world_size: int) -> dict[str, Callable[[Context], Any]]:
    out: dict[str, Callable[[Context], Any]] = {
        "metrics": lambda ctx: _evaluate(ShardedTask(), ctx),
        "twice": lambda ctx: _twice(ctx),
        "limited": lambda ctx: _evaluate(ShardedTask(), ctx, num_steps=2),
        "merged_aggregate": lambda ctx: _evaluate(Merging(), ctx),
        "unmerged_aggregate": lambda ctx: _evaluate(Aggregating(), ctx),
        "named_splits": lambda ctx: _evaluate(NamedSplits(), ctx),
    }
    if world_size > 1:
        out["failing_rank"] = lambda ctx: _evaluate(FailingOnRank1(), ctx)
    out["after_errors"] = lambda ctx: _evaluate(ShardedTask(), ctx)  # the group still works
    return out


def _twice(ctx: Context) -> list[dict[str, Any]]:
    task = ShardedTask()
    ev = TorchEvaluator(task, task.build_model(), ctx=ctx)
    return [ev.evaluate(), ev.evaluate()]


def run(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        _run_scenarios(rank, world_size, out_dir)
    finally:
        # Drop every Python reference into the group (coordinator, metric states) before destroying
        # it: a gloo work released on its worker thread during interpreter shutdown aborts the process.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _run_scenarios(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = Context(rank=rank, world_size=world_size, device="cpu")
    if getattr(ctx, "coordinator", None) is None or ctx.coordinator.world_size != world_size:
        ctx.coordinator = TorchCoordinator()
    results: dict[str, Any] = {}
    for name, fn in scenarios(world_size).items():
        try:
            results[name] = ("ok", fn(ctx))
        except Exception as e:  # recorded for the test to check
            results[name] = ("error", type(e).__name__, str(e), traceback.format_exc())
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
