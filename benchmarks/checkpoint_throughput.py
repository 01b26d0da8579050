"""Checkpoint throughput: CheckpointManager save/load vs raw safetensors + torch.save of the same
tensors to the same disk.

The state is ~1 GiB: a model of 4096x4096 layers (~320 MiB of float32) plus Adam's two moment
buffers. "Raw" writes ``model.safetensors`` with ``safetensors.torch.save_file`` and
``optimizer.pt`` with ``torch.save``, then fsyncs both (the manager fsyncs too: durability is part
of both). The manager does the whole commit protocol: temp dir, sha256 of every byte, fsync,
rename, manifest; loading verifies every hash. Contenders are interleaved; ratios are
raw time / cadence time (>= 0.8 is the target: cadence at least 80% of raw throughput).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file
from torch import nn

LAYERS = 5
WIDTH = 4096


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # creates exp_avg / exp_avg_sq
    model.zero_grad(set_to_none=True)
    return model, opt


def nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return n


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(model, opt, directory: str) -> float:
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}/model.safetensors")
    torch.save({"optimizer": opt.state_dict()}, f"{directory}/optimizer.pt")
    _fsync(f"{directory}/model.safetensors")
    _fsync(f"{directory}/optimizer.pt")
    return time.perf_counter() - start


def raw_load(model, opt, directory: str) -> float:
    start = time.perf_counter()
    model.load_state_dict(load_file(f"{directory}/model.safetensors"))
    opt.load_state_dict(torch.load(f"{directory}/optimizer.pt", weights_only=True)["optimizer"])
    return time.perf_counter() - start


def _trainer(model, opt):
    from cadence.torch import Context, Task, TorchTrainer

    class Stub(Task):  # only its checkpointing is used
        def build_model(self):
            return model

        def build_optimizer(self, m):
            return opt

        def build_inputs(self, split, ctx):
            return []

        def train_step(self, m, batch):
            raise NotImplementedError

        def validation_step(self, m, batch):
            raise NotImplementedError

    return TorchTrainer(Stub(), model, opt, ctx=Context.create(device="cpu"))


def cadence_save(model, opt, directory: str, step: int) -> float:
    from cadence import CheckpointManager

    manager = CheckpointManager(directory, max_to_keep=None)
    trainer = _trainer(model, opt)
    start = time.perf_counter()
    manager.save(step, {"trainer": trainer})
    return time.perf_counter() - start


def cadence_load(model, opt, directory: str, step: int) -> float:
    from cadence import CheckpointManager

    manager = CheckpointManager(directory, writer=False)
    trainer = _trainer(model, opt)
    start = time.perf_counter()
    manager.restore({"trainer": trainer}, step)
    return time.perf_counter() - start


def async_stall(repeats: int = 4, root: str | None = None) -> dict:
    """The training stall per save: how long ``save()`` blocks, synchronous vs ``async_save``.

    As in training, one trainer saves repeatedly: the first asynchronous save allocates the CPU
    copy of the state, later ones copy into it. Reported: the median stall of the saves after the
    first (the steady state), and the first save's stall.
    """
    from cadence import CheckpointManager

    torch.set_num_threads(2)
    model, opt = build()
    base = tempfile.mkdtemp(prefix="cadence-async-bench-", dir=root)
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    try:
        managers = {mode: CheckpointManager(f"{base}/{mode}", max_to_keep=1, async_save=mode == "async")
                    for mode in stalls}
        trainers = {mode: _trainer(model, opt) for mode in stalls}
        for i in range(repeats):
            for mode in ("sync", "async"):
                start = time.perf_counter()
                managers[mode].save(i, {"trainer": trainers[mode]})
                stalls[mode].append(time.perf_counter() - start)
                managers[mode].wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sync, asyn = statistics.median(stalls["sync"][1:]), statistics.median(stalls["async"][1:])
    return {"sync_stall_s": sync, "async_stall_s": asyn, "ratio": asyn / sync,
            "first_sync_stall_s": stalls["sync"][0], "first_async_stall_s": stalls["async"][0],
            "saves": repeats, "target": "async stall <= 10% of a synchronous save"}


def sha256_floor(model, opt, directory: str) -> float:
    """Raw save plus one SHA-256 pass over the same bytes: what any save that hashes every byte
    costs on this machine when the hash cannot run beside the writes."""
    elapsed = raw_save(model, opt, directory)
    start = time.perf_counter()
    for name in ("model.safetensors", "optimizer.pt"):
        digest = hashlib.sha256()
        with open(f"{directory}/{name}", "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    return elapsed + time.perf_counter() - start


def run(repeats: int = 3, root: str | None = None) -> dict:
    torch.set_num_threads(2)
    model, opt = build()
    size = nbytes(model, opt)
    base = tempfile.mkdtemp(prefix="cadence-ckpt-bench-", dir=root)
    times: dict[str, list[float]] = {"raw save": [], "cadence save": [], "raw load": [], "cadence load": [],
                                     "raw save + sha256": []}
    try:
        for i in range(repeats):
            # Every contender writes into a fresh directory that is deleted after its load, so that
            # none of them pays for the others' (or its own earlier) dirty pages.
            raw_dir, ckpt_dir = f"{base}/raw-{i}", f"{base}/cadence-{i}"
            times["raw save + sha256"].append(sha256_floor(model, opt, f"{base}/floor-{i}"))
            shutil.rmtree(f"{base}/floor-{i}")
            times["raw save"].append(raw_save(model, opt, raw_dir))
            times["raw load"].append(raw_load(model, opt, raw_dir))
            shutil.rmtree(raw_dir)
            times["cadence save"].append(cadence_save(model, opt, ckpt_dir, i))
            times["cadence load"].append(cadence_load(model, opt, ckpt_dir, i))
            shutil.rmtree(ckpt_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gib = size / 2**30
    rows = []
    for kind in ("save", "load"):
        raw_t, cad_t = times[f"raw {kind}"], times[f"cadence {kind}"]
        rows.append({
            "direction": kind,
            "raw_s_median": statistics.median(raw_t), "cadence_s_median": statistics.median(cad_t),
            "raw_gib_per_s": gib / statistics.median(raw_t), "cadence_gib_per_s": gib / statistics.median(cad_t),
            "throughput_ratio_median": statistics.median(raw_t) / statistics.median(cad_t),
            "throughput_ratio_best": min(raw_t) / min(cad_t),
        })
    floor = statistics.median(times["raw save + sha256"])
    return {"state_gib": gib, "repeats": repeats, "rows": rows,
            "sha256_floor_s_median": floor,
            "sha256_floor_ratio": statistics.median(times["raw save"]) / floor,
            "target": "cadence throughput >= 0.8x raw, both directions (commit protocol + sha256 included)"}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
