"""Resume cost: mid-epoch resume of a 1,000,000-sample map-style dataset at 3 positions.

cadence's ``ResumableLoader`` restores its position (epoch, global offset) and slices the epoch's
permutation; the alternative most loops use replays the consumed batches of a shuffled
``DataLoader`` to get back to the position. Each measurement runs in a fresh process: "to first
step" is from process start (interpreter, imports, dataset) to the first batch of the resumed
position; "seek" is from building the loader to that batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

N = 1_000_000
BATCH = 256

CHILD = r"""
import json, sys, time
t0 = float(sys.argv[3])
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from cadence.torch import ResumableLoader
N, BATCH, position, mode = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[1]), sys.argv[2]
ds = TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1))
seek = time.time()
if mode == "cadence":
    loader = ResumableLoader(ds, BATCH, shuffle=True, seed=0)
    loader.load_state_dict({"epoch": 0, "offset": position})
    batch = next(iter(loader))
else:
    loader = DataLoader(ds, BATCH, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(0)))
    it = iter(loader)
    for _ in range(position // BATCH):
        next(it)
    batch = next(it)
end = time.time()
print(json.dumps({"to_first_step_s": end - t0, "seek_s": end - seek}))
"""


def measure(position: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(position), mode, repr(time.time()), str(N), str(BATCH)],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout)


def run(repeats: int = 3) -> dict:
    positions = [0, (N // 3) // BATCH * BATCH, (2 * N // 3) // BATCH * BATCH]
    rows = []
    for position in positions:
        row = {"position": position}
        for mode in ("cadence", "replay"):
            runs = [measure(position, mode) for _ in range(repeats)]
            row[f"{mode}_to_first_step_s"] = min(r["to_first_step_s"] for r in runs)
            row[f"{mode}_seek_s"] = min(r["seek_s"] for r in runs)
        rows.append(row)
    return {"samples": N, "batch": BATCH, "repeats": repeats, "rows": rows,
            "target": "cadence's resume time independent of the position (O(1))"}



def markdown_lines(r: dict) -> list[str]:
    """The table of :func:`run`'s result ``r``."""
    lines = [f"## Resume cost ({r['samples']:,} samples, batch {r['batch']}, fresh process each)\n",
             "| position | cadence: to first step s | cadence: seek s | replay: to first step s | replay: seek s |",
             "|---|---|---|---|---|"]
    lines += [f"| {row['position']:,} | {row['cadence_to_first_step_s']:.3f} | {row['cadence_seek_s']:.3f} | "
              f"{row['replay_to_first_step_s']:.3f} | {row['replay_seek_s']:.3f} |" for row in r["rows"]]
    lines.append(f"\nTarget: {r['target']}.\n")
    return lines


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
