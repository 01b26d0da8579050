"""Why steps slow down beside a background save: the stall benchmark's training step timed alone and
beside each kind of work a save does, run in another process on the other core.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint/step_interference.py [--width 3344] [--steps 4]

The step is ``checkpoint_stall.layers_workload``'s (8 bias-free layers + Adam, batch 8, one torch
thread; ``--width 3344``: the 1 GiB state). The neighbours, each a process of its own that loops
until stopped:

- spin: a pure-Python loop (no memory traffic beyond the caches): the core is shared, the memory
  bus is not;
- copy: ``torch`` copies of a 256 MiB buffer into another (a snapshot's copy);
- crc32c: CRC32C over a 256 MiB buffer (a save's checksums);
- write: 64 MiB writes into a file, rewritten from its start (a save's writes into the page cache).

Reported: the median step beside each neighbour over the median step alone, the alone runs taken
before and after so that a drift of the machine shows. Nothing is asserted: it explains the stall
benchmark's "steps during a save".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

BUFFER = 256 << 20


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i


def _copy(stop) -> None:
    a, b = torch.ones(BUFFER // 4), torch.empty(BUFFER // 4)
    while not stop.is_set():
        b.copy_(a)


def _crc32c(stop) -> None:
    import crc32c

    data = memoryview(bytearray(os.urandom(1 << 20)) * (BUFFER >> 20))
    while not stop.is_set():
        crc32c.crc32c(data)


def _write(stop) -> None:
    chunk = os.urandom(64 << 20)
    with tempfile.TemporaryFile() as f:
        while not stop.is_set():
            f.seek(0)
            f.write(chunk)


NEIGHBOURS = {"spin": _spin, "copy": _copy, "crc32c": _crc32c, "write": _write}


def _steps(work, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        work.step(work.model, work.batch).backward()
        work.optimizer.step()
        work.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(width: int = 3344, steps: int = 4) -> dict:
    from benchmarks.checkpoint.stall import layers_workload, optimizer_state_made

    torch.set_num_threads(1)
    work = layers_workload(width)
    optimizer_state_made(work.model, work.optimizer, work.batch, work.step)
    _steps(work, 1)  # warm-up
    before = _steps(work, steps)
    beside = {}
    ctx = mp.get_context("spawn")
    for name, fn in NEIGHBOURS.items():
        stop = ctx.Event()
        neighbour = ctx.Process(target=fn, args=(stop,), daemon=True)
        neighbour.start()
        time.sleep(1.0)  # started, its buffers made
        beside[name] = _steps(work, steps)
        stop.set()
        neighbour.join(30)
    after = _steps(work, steps)
    alone = statistics.fmean([before, after])
    return {"width": width, "steps": steps, "step_s_alone": [before, after],
            "step_s_beside": beside, "ratio_beside": {name: s / alone for name, s in beside.items()},
            "load_average_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=3344)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    r = run(args.width, args.steps)
    print(f"step alone: {r['step_s_alone'][0]:.3f} s before, {r['step_s_alone'][1]:.3f} s after")
    for name, ratio in r["ratio_beside"].items():
        print(f"beside {name:7s}: {r['step_s_beside'][name]:.3f} s, {ratio:.2f}x")


if __name__ == "__main__":
    main()
