"""The one rank of a one-GPU NCCL job of tests/gpu/test_cuda_distributed.py::

    python -m torch.distributed.run --standalone --nproc-per-node 1 tests/gpu/nccl_worker.py STRATEGY MODEL_DIR STEPS [cpu]

cadence starts no process group for a single process, and NCCL refuses two ranks on one GPU, so
on one GPU this worker starts NCCL's group itself (world size 1) and wraps the model as cadence
does on several ranks: ``ddp`` (DistributedDataParallel, gradients all-reduced by NCCL) or
``fsdp`` (FSDP2's ``fully_shard`` over the units the task names, then the root: all-gathers and
reduce-scatters by NCCL; every checkpoint sharded, written through torch.distributed.checkpoint
on cadence's gloo checkpoint group). It trains :class:`DeterministicTinyTask` to global step
STEPS with cadence's Controller and CheckpointManager (asynchronous saves, one every 10 steps),
resuming from MODEL_DIR's latest checkpoint, and writes ``MODEL_DIR/worker.json``: the backend,
the step restored, the global step reached and whether the trainer wrote shards.

``cpu`` (a check of this worker where there is no GPU, not of NCCL): gloo on the CPU instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_tasks import DeterministicTinyTask  # noqa: E402

from cadence import layout  # noqa: E402
from cadence.checkpoint import CheckpointManager  # noqa: E402
from cadence.loop.controller import Controller  # noqa: E402
from cadence.torch import Context  # noqa: E402
from cadence.torch.loop.trainer import TorchTrainer  # noqa: E402
from cadence.torch.runtime.distributed import current_coordinator, shutdown_distributed  # noqa: E402
from cadence.torch.runtime.rng import seed_everything  # noqa: E402


def wrap(model: torch.nn.Module, task: DeterministicTinyTask, strategy: str) -> torch.nn.Module:
    """``model`` as cadence wraps it on several ranks (DDP), or sharded in place as
    :func:`cadence.torch.parallel.sharding.shard_model` shards it (which leaves a single rank's
    model as it is)."""
    if strategy == "ddp":
        device = model_device(model)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for unit in task.fsdp_units(model):
        if unit is not model:
            fully_shard(unit, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=False)
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def main(strategy: str, model_dir: str, steps: int, where: str = "cuda") -> None:
    if where == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")  # env:// from torchrun
    ctx = Context(rank=0, world_size=1, local_rank=0, device=device, seed=1, coordinator=current_coordinator())
    seed_everything(1)
    task = DeterministicTinyTask(n=256)
    model = wrap(task.build_model().to(device), task, strategy)
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    optimizer = task.build_optimizer(module)  # over the shards (DTensors) for fsdp: built after sharding
    trainer = TorchTrainer(task, model, optimizer, task.build_lr_scheduler(optimizer), ctx=ctx)
    manager = CheckpointManager(layout.checkpoints_dir(model_dir), max_to_keep=None, async_save=True)
    with Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=5, checkpoint_interval=10,
                    coordinator=ctx.coordinator, progress=False) as controller:
        restored = controller.restored_step
        controller.train(steps)
    Path(model_dir, "worker.json").write_text(json.dumps({
        "backend": dist.get_backend(), "restored": restored, "global_step": trainer.global_step,
        "writes_shards": trainer.writes_shards,
    }))
    shutdown_distributed(barrier=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
