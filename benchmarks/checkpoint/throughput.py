"""Checkpoint save and load, side by side: cadence against raw safetensors, ``torch.save`` and
torch.distributed.checkpoint (DCP), in one run, on the same state at two sizes (~1 GiB, ~4 GiB).

The state is a model of ``LAYERS`` square float32 layers plus Adam's two moment buffers (three
tensors per parameter), built once per size; every contender saves it and loads it back into the
same live model and optimizer:

- raw: ``model.safetensors`` (``safetensors.torch.save_file`` / ``load_file``) and ``optimizer.pt``
  (``torch.save`` / ``torch.load``). The baseline: every ratio is raw time / contender time, so
  > 1 means faster than raw.
- torch.save: one file of ``{"model", "optimizer"}`` state dicts; loaded with
  ``torch.load(mmap=True, weights_only=True)`` then ``load_state_dict``.
- DCP: ``dcp.save`` / ``dcp.load`` in one process (``no_dist=True``, ``FileSystemWriter(sync_files=True)``)
  of the ``get_state_dict`` dicts, then ``set_state_dict``.
- cadence: ``CheckpointManager.save`` / ``restore`` of a ``TorchTrainer``, the whole commit
  protocol (temp dir, a checksum of every byte, fsync, rename, manifest; loading verifies every
  checksum), once per checksum: CRC32C (the default) and SHA-256.
- floor (save only): the raw save plus one CRC32C pass over the same bytes in memory: what a save
  that checksums every byte costs when the checksum cannot run beside the writes.

Every save includes the fsync of every file it wrote (durability is part of all of them). Each
contender writes a fresh directory that is deleted after its load (so none pays for another's dirty
pages); loads read the files just written, from the page cache. Contenders are interleaved round
robin (the starting contender rotates with each repeat). Reported: the median and the minimum.

Asynchronous saves (the stall, steps beside a save) are ``stall.py``'s.

Last, the loads alone on another shape (``LOAD_SHAPES``: 5 and 20 layers of 4096x4096 float32 + Adam,
0.94 and 3.75 GiB, an independent benchmark's shape): raw, DCP and cadence, into the live model
and optimizer as above, and into the same model with a new optimizer that holds no state yet (what
a new process resumes into: the load allocates the state).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import crc32c
import torch
from safetensors.torch import load_file, save_file
from torch import nn

LAYERS = 8
SIZES = {"1 GiB": 3344, "4 GiB": 6688}  # width: LAYERS * width**2 * 4 bytes * 3 tensors ~ 1 GiB / 4 GiB
REPEATS = {"1 GiB": 3, "4 GiB": 2}
QUICK_SIZES = {"6 MiB": 256, "24 MiB": 512}
LOAD_SHAPES = {"1 GiB": (4096, 5), "4 GiB": (4096, 20)}  # label: (width, layers): the loads alone, another shape
QUICK_LOAD_SHAPES = {"0.2 MiB": (64, 5)}
LOAD_CONTENDERS = ("raw", "dcp", "cadence_crc32c")
BIG = 64 << 20  # states from this size on are garbage-collected after each contender

TARGETS = {
    "save_vs_raw": 0.95, "save_vs_dcp": 1.0, "load_vs_raw": 0.9, "load_vs_dcp": 1.0,
}
TARGET_TEXT = "cadence (crc32c): save >= 0.95x raw and >= 1.0x DCP; load >= 0.9x raw and >= 1.0x DCP"


def build(width: int, layers: int = LAYERS) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # creates exp_avg / exp_avg_sq
    model.zero_grad(set_to_none=True)
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [p.detach() for p in model.parameters()]
    for state in opt.state.values():
        found += [v for v in state.values() if torch.is_tensor(v)]
    return found


def nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(model, opt))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the contenders: each save/load returns the seconds it took --------------------------------------


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


def torch_save(model, opt, directory: str) -> float:
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{directory}/state.pt")
    _fsync(f"{directory}/state.pt")
    return time.perf_counter() - start


def torch_load(model, opt, directory: str) -> float:
    start = time.perf_counter()
    state = torch.load(f"{directory}/state.pt", mmap=True, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    elapsed = time.perf_counter() - start
    # Adam keeps the loaded tensors as they are: its state now maps the file, read on first use.
    # Copied into ordinary memory (off the clock) so that the next contender starts from the same state.
    del state
    for per_param in opt.state.values():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                per_param[key] = value.clone()
    return elapsed


def dcp_save(model, opt, directory: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 storage_writer=dcp.FileSystemWriter(directory, sync_files=True), no_dist=True)
    return time.perf_counter() - start


def dcp_load(model, opt, directory: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
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


def cadence_save(model, opt, directory: str, *, checksum: str = "crc32c") -> float:
    from cadence import CheckpointManager

    manager = CheckpointManager(directory, max_to_keep=None, checksum=checksum)
    trainer = _trainer(model, opt)
    start = time.perf_counter()
    manager.save(1, {"trainer": trainer})
    return time.perf_counter() - start


def cadence_load(model, opt, directory: str) -> float:
    from cadence import CheckpointManager

    manager = CheckpointManager(directory, writer=False)
    trainer = _trainer(model, opt)
    start = time.perf_counter()
    manager.restore({"trainer": trainer}, step=1)
    return time.perf_counter() - start


def floor_save(model, opt, directory: str) -> float:
    elapsed = raw_save(model, opt, directory)
    start = time.perf_counter()
    value = 0
    for t in _tensors(model, opt):
        value = crc32c.crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy(), value)
    return elapsed + time.perf_counter() - start


Fn = Callable[[nn.Module, torch.optim.Optimizer, str], float]
# key: (label, save, load); the first is the baseline of every ratio.
CONTENDERS: dict[str, tuple[str, Fn, Fn | None]] = {
    "raw": ("raw safetensors + torch.save (baseline)", raw_save, raw_load),
    "torch_save": ("torch.save / torch.load(mmap=True) †", torch_save, torch_load),
    "dcp": ("torch.distributed.checkpoint", dcp_save, dcp_load),
    "cadence_crc32c": ("cadence, crc32c (default)", functools.partial(cadence_save, checksum="crc32c"), cadence_load),
    "cadence_sha256": ("cadence, sha256", functools.partial(cadence_save, checksum="sha256"), cadence_load),
    "floor": ("floor: raw save + one crc32c pass", floor_save, None),
}


# -- correctness of the loads (quick runs): scramble the live state, load, compare --------------------


def _reference(model, opt) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(model, opt)]


def _scramble(model, opt) -> None:
    with torch.no_grad():
        for t in _tensors(model, opt):
            t.zero_()


def _check(model, opt, reference: list[torch.Tensor], who: str) -> None:
    now = _tensors(model, opt)
    if len(now) != len(reference) or not all(torch.equal(a, b) for a, b in zip(now, reference)):
        raise AssertionError(f"{who}: the loaded state differs from the saved one")


# -- the floor of a snapshot (stall.py's) ---------------------------------------------------


def _copy_floor(model, opt, repeats: int = 3) -> float:
    """The least a snapshot of the state into CPU memory can stall on this machine: one copy of
    every tensor into memory already allocated and touched (the best of ``repeats``)."""
    tensors = _tensors(model, opt)
    targets = [torch.empty_like(t).copy_(t) for t in tensors]  # allocated and faulted in
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for target, t in zip(targets, tensors):
            target.copy_(t)
        best = min(best, time.perf_counter() - start)
    del targets
    gc.collect()
    return best


# -- one size, then the whole run -----------------------------------------------------------------------


def _summary(ts: list[float]) -> dict:
    return {"median": statistics.median(ts), "min": min(ts)} if ts else {}


def measure_size(label: str, width: int, repeats: int, *, root: str | None = None, verify: bool = False,
                 contender_threads: int | None = None) -> dict:
    step_threads = torch.get_num_threads()
    model, opt = build(width)
    size = nbytes(model, opt)
    reference = _reference(model, opt) if verify else None
    base = tempfile.mkdtemp(prefix="cadence-ckpt-bench-", dir=root)
    times: dict[str, dict[str, list[float]]] = {key: {"save": [], "load": []} for key in CONTENDERS}
    keys = list(CONTENDERS)
    try:
        torch.set_num_threads(contender_threads or os.cpu_count() or 1)
        for i in range(repeats):
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:  # round robin, rotating start
                _, save, load = CONTENDERS[key]
                directory = f"{base}/{key}-{i}"
                times[key]["save"].append(save(model, opt, directory))
                if load is not None:
                    if reference is not None:
                        _scramble(model, opt)
                    times[key]["load"].append(load(model, opt, directory))
                    if reference is not None:
                        _check(model, opt, reference, key)
                shutil.rmtree(directory, ignore_errors=True)
                if size >= BIG:
                    gc.collect()
    finally:
        torch.set_num_threads(step_threads)
        shutil.rmtree(base, ignore_errors=True)
        del model, opt, reference
        gc.collect()

    gib = size / 2**30
    raw = {kind: _summary(times["raw"][kind]) for kind in ("save", "load")}
    rows = []
    for key, (name, _, _) in CONTENDERS.items():
        row: dict = {"key": key, "contender": name}
        for kind in ("save", "load"):
            s = _summary(times[key][kind])
            if not s:
                continue
            row[f"{kind}_s_median"], row[f"{kind}_s_min"] = s["median"], s["min"]
            row[f"{kind}_gib_per_s"] = gib / s["median"]
            row[f"{kind}_ratio_median"] = raw[kind]["median"] / s["median"]
            row[f"{kind}_ratio_min"] = raw[kind]["min"] / s["min"]
        rows.append(row)
    by_key = {row["key"]: row for row in rows}
    cad, dcp_row = by_key["cadence_crc32c"], by_key["dcp"]
    achieved = {
        "save_vs_raw": cad["save_ratio_median"],
        "save_vs_dcp": dcp_row["save_s_median"] / cad["save_s_median"],
        "load_vs_raw": cad["load_ratio_median"],
        "load_vs_dcp": dcp_row["load_s_median"] / cad["load_s_median"],
    }
    targets = []
    for name, value in achieved.items():
        bound = TARGETS[name]
        targets.append({"name": name, "value": value, "bound": bound, "met": value >= bound})
    return {"label": label, "layers": LAYERS, "width": width, "state_bytes": size, "state_gib": gib,
            "repeats": repeats, "contender_threads": contender_threads or os.cpu_count() or 1,
            "rows": rows, "targets": targets, "raw_times": times}


# -- the loads alone, on another shape: into the live optimizer, and into one without state ---------------


def measure_loads(label: str, width: int, layers: int, repeats: int, *, root: str | None = None,
                  verify: bool = False) -> dict:
    """The loads of ``LOAD_CONTENDERS`` on ``layers`` square layers of ``width`` (an independent
    benchmark's shape: 5 x 4096² + Adam is 0.94 GiB), round robin: each contender saves (not
    timed), loads into the live model and optimizer (as in :func:`measure_size`), then into the
    same model with a new optimizer holding no state yet (a new process' resume: the optimizer's
    state is allocated by the load; DCP's ``get_state_dict`` creates it first, inside its time)."""
    model, opt = build(width, layers)
    size = nbytes(model, opt)
    reference = _reference(model, opt) if verify else None
    base = tempfile.mkdtemp(prefix="cadence-ckpt-loads-", dir=root)
    times: dict[str, dict[str, list[float]]] = {key: {"live": [], "fresh": []} for key in LOAD_CONTENDERS}
    keys = list(LOAD_CONTENDERS)
    try:
        for i in range(repeats):
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                _, save, load = CONTENDERS[key]
                assert load is not None
                directory = f"{base}/{key}-{i}"
                save(model, opt, directory)
                for target in ("live", "fresh"):
                    into = opt if target == "live" else torch.optim.Adam(model.parameters(), lr=1e-3)
                    if reference is not None:
                        _scramble(model, into)  # a new optimizer has no state to scramble; opt is kept
                    if size >= BIG:
                        gc.collect()
                    times[key][target].append(load(model, into, directory))
                    if reference is not None:
                        _check(model, into, reference, f"{key} ({target})")
                    del into
                shutil.rmtree(directory, ignore_errors=True)
                if size >= BIG:
                    gc.collect()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        del model, opt, reference
        if size >= BIG:
            gc.collect()
    rows = []
    for key in LOAD_CONTENDERS:
        row: dict = {"key": key, "contender": CONTENDERS[key][0]}
        for target in ("live", "fresh"):
            s, raw = _summary(times[key][target]), _summary(times["raw"][target])
            row[f"{target}_s_median"], row[f"{target}_s_min"] = s["median"], s["min"]
            row[f"{target}_ratio_median"] = raw["median"] / s["median"]
            row[f"{target}_ratio_min"] = raw["min"] / s["min"]
        rows.append(row)
    cad = rows[LOAD_CONTENDERS.index("cadence_crc32c")]
    return {"label": label, "layers": layers, "width": width, "state_bytes": size, "state_gib": size / 2**30,
            "repeats": repeats, "rows": rows, "raw_times": times,
            "target": {"name": "load_vs_raw", "value": cad["live_ratio_median"], "bound": TARGETS["load_vs_raw"],
                       "met": cad["live_ratio_median"] >= TARGETS["load_vs_raw"]}}


def warm_up(root: str | None = None) -> None:
    """Every contender once on a tiny state, off the clock: imports and first-call costs."""
    model, opt = build(64, layers=2)
    base = tempfile.mkdtemp(prefix="cadence-ckpt-warmup-", dir=root)
    try:
        for key, (_, save, load) in CONTENDERS.items():
            save(model, opt, f"{base}/{key}")
            if load is not None:
                load(model, opt, f"{base}/{key}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(quick: bool = False, root: str | None = None, sizes: dict[str, int] | None = None,
        repeats: int | None = None) -> dict:
    """All contenders at each size (``--quick``: two tiny sizes, one repeat, loads checked)."""
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    warm_up(root)
    results = []
    for label, width in sizes.items():
        n = repeats or (1 if quick else REPEATS.get(label, 2))
        results.append(measure_size(label, width, n, root=root, verify=quick))
    return {"quick": quick, "sizes": results, "loads": run_loads(quick, root), "target": TARGET_TEXT}


def run_loads(quick: bool = False, root: str | None = None, shapes: dict[str, tuple[int, int]] | None = None,
              repeats: int | None = None) -> list[dict]:
    """:func:`measure_loads` at each of ``LOAD_SHAPES`` (``quick``: a tiny one, loads checked)."""
    shapes = shapes or (QUICK_LOAD_SHAPES if quick else LOAD_SHAPES)
    return [measure_loads(label, width, layers, repeats or (1 if quick else REPEATS.get(label, 2)), root=root,
                          verify=quick) for label, (width, layers) in shapes.items()]


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="checkpoint benchmark alone (prints JSON, writes no results)")
    parser.add_argument("--quick", action="store_true", help="two tiny sizes, one repeat")
    parser.add_argument("--size", action="append", choices=list(SIZES), help="only these sizes (repeatable)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--loads-only", action="store_true", help="only the loads on LOAD_SHAPES (with --size: those)")
    args = parser.parse_args()
    if args.loads_only:
        shapes = {k: LOAD_SHAPES[k] for k in args.size} if args.size else None
        warm_up()
        print(json.dumps(run_loads(args.quick, shapes=shapes, repeats=args.repeats), indent=1))
        raise SystemExit(0)
    chosen = {k: SIZES[k] for k in args.size} if args.size else None
    print(json.dumps(run(quick=args.quick, sizes=chosen, repeats=args.repeats), indent=1))
