"""Helpers of tests/processes/test_sharded_checkpoint.py.

As a script, one rank of a job that restores a sharded checkpoint the way ``cadence train`` does
and writes what it loaded::

    python -m torch.distributed.run --standalone --nproc-per-node M tests/sharded_worker.py restore CHECKPOINTS OUT

Every rank builds TinyTask's runners with ``strategy="fsdp"`` (on M=1: a plain model, no process
group), restores the latest checkpoint of CHECKPOINTS through a reading ``CheckpointManager``
(collective: the ranks verify the files once in all), then gathers the full model and optimizer
state; rank 0 writes them, with what each rank holds, to OUT (``torch.save``). Or, on 2 ranks::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/sharded_worker.py fail OUT_DIR

asynchronous shard writes (``TorchTrainer.write_shards``) whose directory rank 1 cannot create
(a path under a regular file), then a good one; each rank writes ``OUT_DIR/rank<r>.json``: what
``wait_for_shards`` and the chief's ``save_checkpoint`` raised, and the files of the good save.

As a module, :class:`QuotaTask`: TinyTask whose rank ``quota_rank`` gets a file-size limit
(``RLIMIT_FSIZE``, as a per-process quota) once ``quota_after`` exists -- from then on every file it
writes past ``quota_bytes`` fails with EFBIG: a real, deterministic write failure on one rank.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask  # noqa: E402


class QuotaTask(TinyTask):
    """TinyTask; on rank ``quota_rank``, from training step ``quota_from_step`` on, waits until the
    file ``quota_after`` exists (e.g. an earlier checkpoint's manifest, so that checkpoint is
    whole), then limits the size of the files this process writes to ``quota_bytes``."""

    def __init__(self, quota_rank: int = 1, quota_from_step: int = 1, quota_after: str | None = None,
                 quota_bytes: int = 16384, **kwargs) -> None:
        super().__init__(**kwargs)
        self.quota_rank = quota_rank
        self.quota_from_step = quota_from_step
        self.quota_after = quota_after
        self.quota_bytes = quota_bytes
        self.steps = 0
        self.limited = False

    def train_step(self, model, batch):
        self.steps += 1
        if (not self.limited and self.steps >= self.quota_from_step
                and int(os.environ.get("RANK", "0")) == self.quota_rank):
            deadline = time.monotonic() + 60
            while self.quota_after is not None and not Path(self.quota_after).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.quota_after} did not appear")
                time.sleep(0.01)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.quota_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            self.limited = True
        return super().train_step(model, batch)


def restore(checkpoints: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from cadence.checkpoint import CheckpointManager
    from cadence.torch import Context
    from cadence.torch.runtime.distributed import current_coordinator, shutdown_distributed
    from cadence.torch.experiments.runners import build_runners

    ctx = Context.create(device="cpu", seed=0)  # under torchrun with M > 1: initialises the process group
    coordinator = current_coordinator()
    assert (coordinator is None) == (ctx.world_size == 1)
    trainer, _ = build_runners(TinyTask(n=256), ctx, strategy="fsdp", evaluate=False)
    assert trainer is not None
    step = CheckpointManager(checkpoints, writer=False).restore({"trainer": trainer}, coordinator=coordinator)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(trainer.model, options=options)
    optimizer = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    local = {name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
             for name, p in trainer.model.named_parameters()}
    held = coordinator.all_gather(local) if coordinator is not None else [local]
    if ctx.rank == 0:
        torch.save({
            "step": step,
            "global_step": trainer.global_step,
            "world_size": ctx.world_size,
            "sharded": trainer.writes_shards,
            "held": held,
            "model": {k: v.clone() for k, v in model.items()},
            "optimizer_state": {fqn: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                                for fqn, s in optimizer["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups],
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
        }, out)
    shutdown_distributed(barrier=True)


def failed_write(out_dir: str) -> None:
    import json

    from cadence.checkpoint import checksum
    from cadence.checkpoint.files import MemoryWriter
    from cadence.checkpoint.protocol import ShardTarget
    from cadence.errors import CheckpointError
    from cadence.torch import Context
    from cadence.torch.runtime.distributed import current_coordinator, shutdown_distributed
    from cadence.torch.experiments.runners import build_runners

    ctx = Context.create(device="cpu", seed=0)
    coordinator = current_coordinator()
    assert coordinator is not None and ctx.world_size == 2
    trainer, _ = build_runners(TinyTask(n=256), ctx, strategy="fsdp", evaluate=False)
    assert trainer is not None and trainer.writes_shards
    out = Path(out_dir)
    blocker = out / "blocker"
    if ctx.rank == 0:
        blocker.write_text("a file, not a directory")
    coordinator.barrier()

    def target(step: int, directory: Path) -> ShardTarget:
        return ShardTarget(step, str(directory), checksum.DEFAULT_ALGORITHM, background=True)

    def bad(step: int) -> ShardTarget:  # rank 1 cannot create its directory: NotADirectoryError
        return target(step, out / f"step{step}" if ctx.rank == 0 else blocker / f"step{step}")

    result: dict = {}
    # 1. the failure is raised by wait_for_shards
    trainer.prepare_checkpoint()
    trainer.write_shards(bad(1))
    try:
        trainer.wait_for_shards()
        result["wait"] = None
    except CheckpointError as e:
        result["wait"] = str(e)
    # 2. by the chief's save_checkpoint (as the asynchronous commit calls it); by wait on the others
    trainer.prepare_checkpoint()
    trainer.write_shards(bad(2))
    try:
        if ctx.rank == 0:
            trainer.save_checkpoint(MemoryWriter(2))
        else:
            trainer.wait_for_shards()
        result["save"] = None
    except CheckpointError as e:
        result["save"] = str(e)
    # 3. raised once: the next save goes through
    trainer.prepare_checkpoint()
    trainer.write_shards(target(3, out / "step3"))
    if ctx.rank == 0:
        writer = MemoryWriter(3)
        trainer.save_checkpoint(writer)
        result["added"] = [[sorted(files), rank] for files, rank in writer.added]
    else:
        trainer.wait_for_shards()
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    shutdown_distributed(barrier=True)


if __name__ == "__main__":
    if sys.argv[1] == "restore":
        restore(sys.argv[2], sys.argv[3])
    else:
        failed_write(sys.argv[2])
