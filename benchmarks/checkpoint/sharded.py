"""Sharded checkpoints under FSDP2, side by side: cadence against plain torch.distributed.checkpoint
(DCP), in one run, on 1, 2 and 3 ranks (torchrun processes, gloo, CPU).

    OMP_NUM_THREADS=1 python benchmarks/checkpoint/sharded.py [--size-gib 3] [--repeats 5] [--quick]

The state is a model of ``LAYERS`` square float32 linear layers sharded with FSDP2's
``fully_shard`` plus AdamW's two moment buffers: ``--size-gib`` in all (three tensors per
parameter; the default, 3 GiB, is 1 GiB of parameters). For each world size one torchrun launch
(``sharded_worker.py``) measures, ``--repeats`` times with the contender that goes
first alternating, after a warm-up round of both (off the clock):

- plain DCP: ``dcp.save`` (``FileSystemWriter``: one file per rank, fsynced; no checksum, no
  commit) and ``dcp.load`` into the live model and optimizer;
- cadence: ``CheckpointSession.save`` of a ``TorchTrainer`` built by ``build_runners(...,
  strategy="fsdp")`` through a ``CheckpointManager`` -- the whole sharded save: each rank writes
  its shards through DCP, reads them back to checksum them (CRC32C), the ranks' files are gathered
  and the chief commits (state.json, rename, MANIFEST.json last) -- and ``CheckpointSession.restore``
  (each rank verifies its share of the files, the ranks agree, then the DCP load).

Saves and loads are timed on the wall clock from a barrier of all ranks before to one after.
Write throughput is aggregate: the bytes of every rank's files together / the save's wall time.
Each checkpoint goes into a fresh directory that is deleted after its load, so loads read the
files just written, from the page cache (dropping it needs root). The ranks share the machine's
cores (``OMP_NUM_THREADS=1``).

Standalone, the script writes ``results/sharded_checkpoint.md`` and ``.json`` (``--out``; with
``--quick``: only where ``--out`` says). ``benchmarks/run.py`` runs it as ``sharded`` and puts its
table into ``results/latest.md`` (and writes ``results/sharded_checkpoint.*`` too).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharded_worker.py"
RESULTS = HERE.parent / "results"

WORLD_SIZES = (1, 2, 3)
LAYERS = 8
SIZE_GIB = 3.0  # parameters + AdamW's two moments: 1 GiB of parameters
REPEATS = 5
QUICK_SIZE_GIB = 6 / 1024  # 6 MiB
TENSORS_PER_PARAMETER = 3  # the parameter, exp_avg, exp_avg_sq


def width_for(size_gib: float, layers: int = LAYERS) -> int:
    """The layer width whose model and AdamW state total about ``size_gib``."""
    return max(8, round(math.sqrt(size_gib * 2**30 / (4 * TENSORS_PER_PARAMETER * layers))))


def run_world(world_size: int, width: int, layers: int, repeats: int, root: str, *, verify: bool,
              quiet: bool) -> dict:
    """One torchrun launch of ``world_size`` ranks; rank 0's measurements."""
    out = os.path.join(root, f"result-{world_size}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
           str(WORKER), "--out", out, "--root", root, "--width", str(width), "--layers", str(layers),
           "--repeats", str(repeats), *(["--verify"] if verify else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE if quiet else None,
                          stderr=subprocess.STDOUT if quiet else None)
    if proc.returncode != 0:
        tail = (proc.stdout or "")[-4000:]
        raise RuntimeError(f"the {world_size}-rank benchmark failed (exit {proc.returncode}){': ' + tail if tail else ''}")
    with open(out) as f:
        return json.load(f)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _phase(rounds: list[dict], kind: str, name: str) -> float | None:
    """The median over repeats of the slowest rank's seconds in phase ``name`` (None: not recorded)."""
    per_round = [max((ranks.get(name, 0.0) for ranks in r[f"{kind}_phases"]), default=0.0) for r in rounds]
    if not any(name in ranks for r in rounds for ranks in r[f"{kind}_phases"]):
        return None
    return _median(per_round)


def _share(rounds: list[dict], kind: str, name: str) -> float:
    """The median over repeats of (the slowest rank's seconds in ``name``) / the wall time."""
    return _median([max(ranks.get(name, 0.0) for ranks in r[f"{kind}_phases"]) / r[f"{kind}_s"] for r in rounds])


def summarize(raw: dict) -> dict:
    """One world size's row: medians, throughputs, ratios, cadence's phases."""
    row: dict = {"world_size": raw["world_size"], "state_bytes": raw["state_bytes"],
                 "state_gib": raw["state_bytes"] / 2**30, "repeats": raw["repeats"], "contenders": {}}
    for key, rounds in raw["rounds"].items():
        save = [r["save_s"] for r in rounds]
        load = [r["load_s"] for r in rounds]
        written = _median([r["bytes"] for r in rounds])
        row["contenders"][key] = {
            "save_s_median": _median(save), "save_s_min": min(save), "load_s_median": _median(load),
            "load_s_min": min(load), "bytes_written": written,
            "write_gib_per_s": written / 2**30 / _median(save), "read_gib_per_s": written / 2**30 / _median(load),
        }
    cad, plain = row["contenders"]["cadence"], row["contenders"]["dcp"]
    row["save_ratio"] = cad["save_s_median"] / plain["save_s_median"]  # cadence time / DCP time
    row["load_ratio"] = cad["load_s_median"] / plain["load_s_median"]
    rounds = raw["rounds"]["cadence"]
    row["checksum_save_share"] = _share(rounds, "save", "checksum")
    row["verify_load_share"] = _share(rounds, "load", "verify")
    row["phases"] = {
        "save": {name: _phase(rounds, "save", name) for name in ("write_shards", "dcp_write", "checksum", "commit")},
        "load": {name: _phase(rounds, "load", name) for name in ("verify", "dcp_read")},
    }
    row["rounds"] = raw["rounds"]  # every repeat, every rank's phases
    row["warmup"] = raw["warmup"]
    return row


def run(quick: bool = False, root: str | None = None, size_gib: float | None = None, repeats: int | None = None,
        world_sizes: tuple[int, ...] = WORLD_SIZES, quiet: bool = True) -> dict:
    """Both contenders on each world size (``quick``: a 6 MiB state, one repeat, every load checked)."""
    size_gib = size_gib if size_gib is not None else (QUICK_SIZE_GIB if quick else SIZE_GIB)
    repeats = repeats or (1 if quick else REPEATS)
    width = width_for(size_gib)
    base = tempfile.mkdtemp(prefix="cadence-sharded-bench-", dir=root)
    try:
        rows = [summarize(run_world(n, width, LAYERS, repeats, base, verify=quick, quiet=quiet)) for n in world_sizes]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"quick": quick, "layers": LAYERS, "width": width, "size_gib": size_gib, "repeats": repeats,
            "omp_num_threads": 1, "rows": rows}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a 6 MiB state, one repeat, loads checked")
    parser.add_argument("--size-gib", type=float, default=None,
                        help=f"the state saved, parameters + AdamW's moments (default {SIZE_GIB:g})")
    parser.add_argument("--repeats", type=int, default=None, help=f"default {REPEATS} (quick: 1)")
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)), help="comma-separated")
    parser.add_argument("--root", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the markdown table (and .json beside it); default results/sharded_checkpoint.md, "
                             "none with --quick")
    args = parser.parse_args()
    from benchmarks.checkpoint.save_load_page import sharded_lines
    from benchmarks.common.results_file import header, machine, write_results

    result = run(quick=args.quick, root=args.root, size_gib=args.size_gib, repeats=args.repeats,
                 world_sizes=tuple(int(n) for n in args.world_sizes.split(",")), quiet=False)
    text = "\n".join(header(machine(), reproduce="OMP_NUM_THREADS=1 python benchmarks/checkpoint/sharded.py")
                     + sharded_lines(result))
    print(text)
    out = args.out if args.out is not None else (None if args.quick else RESULTS / "sharded_checkpoint.md")
    write_results(out, text, result)


if __name__ == "__main__":
    main()
