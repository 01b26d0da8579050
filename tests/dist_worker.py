"""Worker scenarios of the multi-process tests, run as every rank of a torchrun job::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py SCENARIO OUT_DIR [ARG ...]

(or as a plain ``python tests/dist_worker.py ...`` for one process). Each rank writes what it saw
to ``OUT_DIR/<scenario>-rank<r>.json``; the tests compare the ranks' reports.

Also holds :class:`PidTask`, which the launch tests load by path (``tests/dist_worker.py:PidTask``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask  # noqa: E402

from cadence.checkpoint import CheckpointManager  # noqa: E402
from cadence.torch import Context, Task, build_runners  # noqa: E402
from cadence.torch.checkpoint_io.state import unwrap_model  # noqa: E402
from cadence.torch.parallel.replicas import sync_buffers  # noqa: E402
from cadence.torch.runtime.distributed import shutdown_distributed  # noqa: E402


class PidTask(TinyTask):
    """TinyTask whose train data is this rank's share (``ctx.loader``); each rank writes its pid
    to ``<pid_dir>/rank<r>`` when it builds its train data (a test can then kill it)."""

    def __init__(self, pid_dir: str, fail_rank: int | None = None, fail_step: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pid_dir = pid_dir
        self.fail_rank = fail_rank  # this rank raises at its train step fail_step
        self.fail_step = fail_step
        self.rank = 0
        self.steps = 0

    def build_inputs(self, split, ctx):
        if split == "train":
            self.rank = ctx.rank
            Path(self.pid_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
            return ctx.loader(self.train_set, self.batch_size, seed=ctx.seed)
        return super().build_inputs(split, ctx)

    def train_step(self, model, batch):
        self.steps += 1
        if self.rank == self.fail_rank and self.steps == self.fail_step:
            raise RuntimeError(f"planted failure on rank {self.rank}")
        return super().train_step(model, batch)


class IdsTask(Task):
    """A linear model with dropout (so the RNG matters) on samples that carry their index; every
    train step records the indices of its batch in ``seen``."""

    def __init__(self, n: int = 203, batch_size: int = 4) -> None:
        g = torch.Generator().manual_seed(3)
        self.data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))
        self.batch_size = batch_size
        self.seen: list[list[int]] = []

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 1))

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def build_inputs(self, split, ctx):
        return ctx.loader(self.data, self.batch_size, train=split == "train")

    def train_step(self, model, batch):
        x, y, ids = batch
        self.seen.append(ids.tolist())
        return F.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y, _ = batch
        return {"loss": F.mse_loss(model(x), y)}


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def draws() -> list[float]:
    """The next numbers of every global RNG."""
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("cadence").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- scenarios -------------------------------------------------------------------------------------


def basics(ctx: Context) -> dict:
    """Collectives, dataset shards, the loaders, DDP training, and buffers synced from rank 0."""
    c, r, w = ctx.coordinator, ctx.rank, ctx.world_size
    res: dict = {"rank": r, "world_size": w, "local_rank": ctx.local_rank, "is_chief": ctx.is_chief,
                 "coordinator": type(c).__name__, "device": str(ctx.device)}
    res["any_last"] = c.any(r == w - 1)
    res["any_none"] = c.any(False)
    c.barrier()
    res["broadcast"] = c.broadcast({"from": r}, src=w - 1)
    res["all_gather"] = c.all_gather(r * 10)
    res["gather"] = ctx.gather(f"r{r}", dst=0)
    res["gather_last"] = ctx.gather(r, dst=w - 1)
    res["allgather"] = ctx.allgather([r])
    res["ctx_broadcast"] = ctx.broadcast(r + 100, src=1)

    ds = TensorDataset(torch.arange(1001))
    shard = ctx.wrap_dataset(ds)
    res["shard"] = [int(shard[i][0]) for i in range(len(shard))]
    res["unsharded"] = len(ctx.wrap_dataset(ds, shard=False))
    res["eval_loader"] = [int(v) for (b,) in ctx.loader(ds, 64, train=False) for v in b]
    loader = ctx.loader(ds, 16, epochs=1)
    batches = [b.tolist() for (b,) in loader]
    res["train_len"] = len(loader)
    res["train_batches"] = [len(b) for b in batches]
    res["train_samples"] = sum(batches, [])

    torch.manual_seed(1000 + r)  # a different init on every rank: DDP starts them all from rank 0's
    model = nn.Linear(4, 2)
    wrapped = ctx.wrap_model(model)
    res["wrapped"] = type(wrapped).__name__
    res["params_after_wrap"] = flat(model)
    reference = copy.deepcopy(model)  # one process on the global batches: what DDP must match
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    b = 4
    x, y = torch.randn(3 * w * b, 4, generator=g), torch.randn(3 * w * b, 2, generator=g)
    for step in range(3):
        mine = slice(step * w * b + r * b, step * w * b + (r + 1) * b)
        opt.zero_grad()
        F.mse_loss(wrapped(x[mine]), y[mine]).backward()
        opt.step()
        every = slice(step * w * b, (step + 1) * w * b)
        ref_opt.zero_grad()
        F.mse_loss(reference(x[every]), y[every]).backward()
        ref_opt.step()
    res["params_after_train"] = flat(model)
    res["params_reference"] = flat(reference)

    # rank 0's buffers everywhere, of any dtype and shape, in one broadcast; the parameters left alone
    bn = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    bn.register_buffer("mask", torch.tensor([r % 2 == 0, r % 2 == 1, True]))
    bn.register_buffer("bf16", torch.tensor(r + 0.5, dtype=torch.bfloat16))  # 0-dim
    bn.register_buffer("empty", torch.zeros(0))
    bn.register_buffer("cache", torch.full((2,), float(r)), persistent=False)  # not saved: not synced
    bn[1].running_mean.fill_(r + 1.0)
    bn[1].num_batches_tracked.fill_(10 * r)
    with torch.no_grad():
        bn[0].weight.fill_(r)
    extra = torch.full((2, 2), r, dtype=torch.complex64)
    sync_buffers(bn, [extra])
    res["synced"] = {k: v.float().tolist() if v.dtype == torch.bfloat16 else v.tolist()
                     for k, v in {**bn.state_dict(), "cache": bn.cache}.items()}
    res["synced_extra"] = [str(v) for v in extra.flatten().tolist()]
    return res


def ckpt(ctx: Context, phase: str, model_dir: str) -> dict:
    """``save``: train 3 steps and checkpoint; ``resume``: restore. Then both draw the next random
    numbers and train 4 more steps, recording the samples each rank took."""
    warnings = Warnings()
    task = IdsTask()
    trainer, _ = build_runners(task, ctx, evaluate=False)
    manager = CheckpointManager(model_dir, writer=ctx.is_chief, max_to_keep=None)
    if phase == "save":
        trainer.initialize()
        trainer.train(3)
        trainer.prepare_checkpoint()  # collective: every rank's RNG state to the chief
        if ctx.is_chief:
            manager.save(trainer.global_step, {"trainer": trainer})
        ctx.barrier()
    else:
        assert manager.restore({"trainer": trainer}) == 3
    res: dict = {"rank": ctx.rank, "world_size": ctx.world_size, "step": trainer.global_step,
                 "wrapped": type(trainer.model).__name__, "randoms": draws()}
    task.seen.clear()
    trainer.train(4)
    res["ids"] = task.seen
    res["params"] = flat(unwrap_model(trainer.model))
    res["warnings"] = warnings.messages
    return res


def cache(ctx: Context, root: str) -> dict:
    """Build a dataset once on rank 0 (a counter file records every build) and load it everywhere."""
    counter = Path(root, "builds.txt")
    Path(root).mkdir(parents=True, exist_ok=True)

    def record(what: str) -> None:
        with open(counter, "a") as f:
            f.write(f"{what} rank{ctx.rank}\n")

    @ctx.cache_dataset("toy", "v1", cache_dir=Path(root, "shared"))
    def build():
        record("toy")
        time.sleep(0.3)  # the other ranks wait for it
        g = torch.Generator().manual_seed(0)
        return {"x": torch.randn(10, 3, generator=g), "y": np.arange(10, dtype=np.int16),
                "meta": ("toy", 1, 2.5), "n": np.int64(10), "list": [torch.ones(2), None]}

    value = build()
    res: dict = {
        "rank": ctx.rank,
        "x_sum": float(value["x"].sum()),
        "types": [type(value["x"]).__name__, type(value["y"]).__name__, str(value["y"].dtype),
                  type(value["meta"]).__name__, type(value["n"]).__name__, type(value["list"]).__name__],
        "y": value["y"].tolist(),
        "meta": list(value["meta"]),
    }

    # A cache dir local to each "machine": rank 0's file is not visible to the others.
    @ctx.cache_dataset("toy", "v1", cache_dir=Path(root, f"node{ctx.rank}"))
    def build_local():
        record("local")
        return {"ids": torch.arange(5) * 7}

    res["local"] = build_local()["ids"].tolist()

    @ctx.cache_dataset("bad", "v1", cache_dir=Path(root, "shared"))
    def bad():
        record("bad")
        return {"dataset": TensorDataset(torch.arange(3))}

    try:
        bad()
        res["bad"] = None
    except TypeError as e:
        res["bad"] = f"TypeError: {e}"
    ctx.barrier()  # still in step after the error
    return res


SCENARIOS = {"basics": basics, "ckpt": ckpt, "cache": cache}


def main(argv: list[str]) -> None:
    scenario, out, *args = argv
    ctx = Context.create("cpu", seed=5)
    res = SCENARIOS[scenario](ctx, *args)
    Path(out, f"{scenario}-rank{ctx.rank}.json").write_text(json.dumps(res))
    del ctx
    shutdown_distributed(barrier=True)  # all done: close the group before exiting


if __name__ == "__main__":
    main(sys.argv[1:])
