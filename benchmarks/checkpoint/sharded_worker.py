"""Rank worker of ``benchmarks/checkpoint/sharded.py`` (one world size per launch)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node N \\
        benchmarks/checkpoint/sharded_worker.py --out RESULT.json --root DIR --width W --layers L --repeats R

Every rank builds the same model (``L`` square ``W``x``W`` float32 linear layers, no bias), shards
it with FSDP2 ``fully_shard`` (each layer a unit, then the root) and takes one AdamW step, so the
state is the parameters plus Adam's two moments (three tensors per parameter). Then, side by side,
``R`` repeats, the contender that goes first alternating:

- plain DCP: ``dcp.save`` of the ``get_model_state_dict`` / ``get_optimizer_state_dict`` dicts
  through a ``FileSystemWriter`` (DCP's defaults: one file per rank, fsynced), then ``dcp.load``
  into the live state (``set_model_state_dict`` / ``set_optimizer_state_dict``). No checksums,
  no commit.
- cadence: ``CheckpointSession.save`` of a ``TorchTrainer`` (built by ``build_runners(...,
  strategy="fsdp")``) through a ``CheckpointManager`` (the chief the writer, as in a run):
  RNG states gathered, the chief's temp dir broadcast, every rank's DCP write + read-back CRC32C
  + the gather of the files, the chief's commit (state.json, rename, MANIFEST.json last), a
  barrier; then ``CheckpointSession.restore`` (the manifest read, each rank's share of the files
  verified, the ranks agreeing, the DCP load, RNG and data position restored).

A warm-up round of both, off the clock, comes first. Each save and load is timed on the wall
clock between two barriers of all ranks. Each checkpoint is written into a fresh directory,
deleted after its load: loads read the files just written, from the page cache (dropping it needs
root). Inside cadence's save and load each rank records its seconds in: ``write_shards`` (the
trainer's), DCP's save and load as cadence calls them, the checksums (``checksum_of``: on save the
read-back of the files it wrote, on load inside the verification), the chief's commit
(``CheckpointManager.save``) and the verification of its share (``manifest.verify_all``). Rank 0
writes the measurements to ``--out`` (JSON).

On one rank ``build_runners`` does not shard (``shard_model`` returns the model as it is, and
cadence then writes ``model.safetensors`` + ``optimizer.safetensors``): there the worker applies
``fully_shard`` itself over the one-rank group and builds the ``TorchTrainer`` from it, so that
every world size measures the sharded path.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint import manifest as manifest_lib
from cadence.checkpoint.session import CheckpointSession
from cadence.torch import Context, Task, TorchTrainer, build_runners
from cadence.torch.checkpoint_io import sharded as sharded_checkpoint
from cadence.torch.runtime.distributed import shutdown_distributed
from cadence.torch.parallel.sharding import is_sharded


class BenchTask(Task):
    """``layers`` square linear layers of ``width``, AdamW; only its checkpointing is used."""

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        width, layers = self.params["width"], self.params["layers"]
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def build_inputs(self, split: str, ctx: Context) -> list:
        return []

    def train_step(self, model: nn.Module, batch: Any) -> Any:
        raise NotImplementedError

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        raise NotImplementedError


def build_trainer(width: int, layers: int, ctx: Context) -> TorchTrainer:
    """A trainer of a model sharded by FSDP2, with AdamW's state created (one step)."""
    task = BenchTask(width=width, layers=layers)
    if ctx.world_size > 1:
        trainer, _ = build_runners(task, ctx, strategy="fsdp", evaluate=False)
        assert trainer is not None
    else:  # build_runners shards nothing on one rank: shard over the one-rank group as shard_model does
        from torch.distributed.fsdp import fully_shard

        model = task.build_model()
        for unit in reversed(task.fsdp_units(model)):
            fully_shard(unit, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=False)
        trainer = TorchTrainer(task, model, task.build_optimizer(model), ctx=ctx)
    assert is_sharded(trainer.model) and trainer.writes_shards
    trainer.write_shards = _timed("write_shards", trainer.write_shards)  # type: ignore[method-assign]
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.grad = p.detach() * 1e-3  # a DTensor with the parameter's placements
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return trainer


def _tensors(trainer: TorchTrainer) -> list[torch.Tensor]:
    """This rank's local shards of every parameter and optimizer-state tensor."""
    found = [p.detach() for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        found += [v for v in state.values() if torch.is_tensor(v)]
    return [t.to_local() if hasattr(t, "to_local") else t for t in found]


# -- instrumentation of cadence's save and load: seconds per phase, this rank ------------------------

PHASES: dict[str, float] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start

    return wrapper


# write_shards calls checksum_lib.checksum_of (the read-back of the files it wrote, mapped, and
# their checksum); the manager calls manifest_lib.verify_all: module attributes, looked up per call.
checksum_lib.checksum_of = _timed("checksum", checksum_lib.checksum_of)
manifest_lib.verify_all = _timed("verify", manifest_lib.verify_all)


class _TimedDCP:
    """torch.distributed.checkpoint as cadence's sharded_checkpoint module sees it: its save and
    load timed (the plain-DCP contender calls the module itself, untimed)."""

    save = staticmethod(_timed("dcp_write", dcp.save))
    load = staticmethod(_timed("dcp_read", dcp.load))

    def __getattr__(self, name: str) -> Any:
        return getattr(dcp, name)


sharded_checkpoint.dcp = _TimedDCP()


# -- the contenders -----------------------------------------------------------------------------------


def _state(trainer: TorchTrainer) -> dict[str, Any]:
    return {"model": get_model_state_dict(trainer.model),
            "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}


def dcp_save(trainer: TorchTrainer, directory: str, ctx: Context) -> Callable[[], None]:
    def save() -> None:
        dcp.save(_state(trainer), storage_writer=dcp.FileSystemWriter(directory))

    return save


def dcp_load(trainer: TorchTrainer, directory: str, ctx: Context) -> Callable[[], None]:
    def load() -> None:
        state = _state(trainer)
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
        set_model_state_dict(trainer.model, state["model"])
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])

    return load


def _session(trainer: TorchTrainer, directory: str, ctx: Context) -> CheckpointSession:
    manager = CheckpointManager(directory, writer=ctx.is_chief)  # as a run's: the chief writes
    if ctx.is_chief:  # the commit, timed (the chief's only)
        manager.save = _timed("commit", manager.save)  # type: ignore[method-assign]
    return CheckpointSession(manager, ctx.coordinator, on_save=lambda path: None, on_load=lambda path: None,
                             shards=trainer)


def cadence_save(trainer: TorchTrainer, directory: str, ctx: Context) -> Callable[[], None]:
    session = _session(trainer, directory, ctx)  # off the clock: a run makes its manager once

    def save() -> None:
        session.save(1, lambda: {"trainer": trainer}, trainer.prepare_checkpoint)

    return save


def cadence_load(trainer: TorchTrainer, directory: str, ctx: Context) -> Callable[[], None]:
    session = _session(trainer, directory, ctx)

    def load() -> None:
        if session.restore({"trainer": trainer}, step=1) != 1:
            raise AssertionError("cadence restored no checkpoint")

    return load


CONTENDERS = {"dcp": (dcp_save, dcp_load), "cadence": (cadence_save, cadence_load)}


def collective_seconds(fn: Callable[[], None]) -> float:
    """``fn`` on every rank, timed from a barrier before to a barrier after (this rank's clock)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def one_round(trainer: TorchTrainer, key: str, directory: str, ctx: Context,
              reference: list[torch.Tensor] | None) -> dict[str, Any]:
    """One save and load of contender ``key`` into ``directory`` (deleted afterwards)."""
    make_save, make_load = CONTENDERS[key]
    PHASES.clear()
    save_s = collective_seconds(make_save(trainer, directory, ctx))
    save_phases = dict(PHASES)
    written = directory_bytes(directory) if ctx.is_chief else 0
    if reference is not None:  # quick runs: the load must bring back what was saved
        with torch.no_grad():
            for t in _tensors(trainer):
                t.zero_()
    PHASES.clear()
    load_s = collective_seconds(make_load(trainer, directory, ctx))
    load_phases = dict(PHASES)
    if reference is not None:
        now = _tensors(trainer)
        if len(now) != len(reference) or not all(torch.equal(a, b) for a, b in zip(now, reference)):
            raise AssertionError(f"{key}: rank {ctx.rank} loaded a state that differs from the one saved")
    dist.barrier()
    if ctx.is_chief:
        shutil.rmtree(directory, ignore_errors=True)
    gc.collect()
    dist.barrier()
    return {"save_s": save_s, "load_s": load_s, "bytes": written, "save_phases": save_phases,
            "load_phases": load_phases}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--verify", action="store_true", help="check that every load restores the saved state")
    args = parser.parse_args()

    # Our own group first (a long timeout: a rank may wait out another's multi-GiB write), on one
    # rank too; Context.create then takes it (and its coordinator) as it is.
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(minutes=30))
    ctx = Context.create(device="cpu")
    assert ctx.world_size == dist.get_world_size() and ctx.coordinator is not None

    log = (lambda message: print(f"[{ctx.world_size} rank(s)] {message}", flush=True)) if ctx.is_chief else (
        lambda message: None)
    base = os.path.join(args.root, f"ranks{ctx.world_size}")
    if ctx.is_chief:
        os.makedirs(base, exist_ok=True)

    start = time.perf_counter()
    trainer = build_trainer(args.width, args.layers, ctx)
    local_bytes = sum(t.numel() * t.element_size() for t in _tensors(trainer))
    state_bytes = sum(ctx.coordinator.all_gather(local_bytes))
    log(f"state {state_bytes / 2**30:.2f} GiB built in {time.perf_counter() - start:.1f} s")
    reference = [t.clone() for t in _tensors(trainer)] if args.verify else None

    # Warm-up, off the clock: each contender once on the same state (imports, first calls, the
    # trainer's checkpoint process group; and the first multi-GiB write into a fresh part of the
    # disk, measured here up to 4x slower than the next ones: it would fall on whoever goes first).
    warmup = {}
    for key in CONTENDERS:
        result = one_round(trainer, key, os.path.join(base, f"warmup-{key}"), ctx, reference)
        warmup[key] = {"save_s": result["save_s"], "load_s": result["load_s"]}
        log(f"warm-up {key}: save {result['save_s']:.2f} s, load {result['load_s']:.2f} s (not counted)")

    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in CONTENDERS}
    keys = list(CONTENDERS)
    for i in range(args.repeats):
        for key in keys[i % 2:] + keys[:i % 2]:  # alternating which goes first
            result = one_round(trainer, key, os.path.join(base, f"{key}-{i}"), ctx, reference)
            # every rank's phases, for the chief to report
            result["save_phases"] = ctx.coordinator.all_gather(result["save_phases"])
            result["load_phases"] = ctx.coordinator.all_gather(result["load_phases"])
            rounds[key].append(result)
            log(f"repeat {i + 1}/{args.repeats} {key}: save {result['save_s']:.2f} s, load {result['load_s']:.2f} s, "
                f"{result['bytes'] / 2**30:.2f} GiB written")

    if ctx.is_chief:
        shutil.rmtree(base, ignore_errors=True)
        document = {
            "world_size": ctx.world_size, "width": args.width, "layers": args.layers, "repeats": args.repeats,
            "state_bytes": state_bytes, "torch_threads": torch.get_num_threads(), "verified": args.verify,
            "warmup": warmup, "rounds": rounds,
        }
        with open(args.out, "w") as f:
            json.dump(document, f, indent=1)
    shutdown_distributed(barrier=True)


if __name__ == "__main__":
    main()
