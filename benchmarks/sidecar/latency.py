"""Sidecar latency: seconds from a checkpoint's commit (its manifest written) to the sidecar
starting to evaluate it, with the default ``poll_interval`` (0.5 s).

A trainer thread commits small checkpoints at irregular intervals (so commits do not phase-lock
with the polling); the real :class:`~cadence.sidecar.evaluator.SidecarEvaluator` runs in the main thread
with leases, the evaluation log and verification, and an evaluator that records when each
evaluation starts.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time

from cadence import CheckpointManager
from cadence.sidecar.evaluator import SidecarEvaluator

N = 20


class Model:
    def __init__(self) -> None:
        self.step = 0

    def save_checkpoint(self, writer):
        writer.write("model.bin", json.dumps({"step": self.step}).encode() + b"\0" * 65536)
        return {"global_step": self.step}


class StampingEvaluator:
    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.step = -1

    def load_checkpoint(self, reader, state):
        self.step = json.loads(reader.read("model.bin").rstrip(b"\0"))["step"]

    def evaluate(self, num_steps):
        self.started[self.step] = time.time()
        return {"metric": float(self.step)}


def run(n: int = N, poll_interval: float = 0.5) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(f"{tmp}/checkpoints", max_to_keep=None)
        committed: dict[int, float] = {}
        model = Model()
        rng = random.Random(0)

        def trainer() -> None:
            time.sleep(1.0)
            for i in range(1, n + 1):
                model.step = i
                manager.save(i, {"trainer": model})
                committed[i] = time.time()
                time.sleep(rng.uniform(0.6, 1.4))
            manager.mark_final(n)

        thread = threading.Thread(target=trainer)
        thread.start()
        evaluator = StampingEvaluator()
        SidecarEvaluator(evaluator, tmp, poll_interval=poll_interval, timeout=60).start()
        thread.join()
    latencies = sorted(evaluator.started[s] - committed[s] for s in committed)
    p95 = latencies[max(0, round(0.95 * len(latencies)) - 1)]
    return {"checkpoints": n, "poll_interval_s": poll_interval, "median_s": statistics.median(latencies),
            "p95_s": p95, "max_s": latencies[-1], "target": "median <= 1 s"}



def markdown_lines(r: dict) -> list[str]:
    """The table of :func:`run`'s result ``r``."""
    return [(f"## Sidecar latency (commit → evaluation starts, {r['checkpoints']} checkpoints, "
             f"poll {r['poll_interval_s']} s)\n"),
            "| median s | p95 s | max s |", "|---|---|---|",
            f"| {r['median_s']:.3f} | {r['p95_s']:.3f} | {r['max_s']:.3f} |", f"\nTarget: {r['target']}.\n"]


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
