"""The sidecar latency benchmark's trainer and evaluator, shared by its 1-process and 2-rank rows
(:mod:`benchmarks.sidecar.latency`, :mod:`benchmarks.sidecar.latency_ranks`)."""

from __future__ import annotations

import json
import random
import time

from cadence import CheckpointManager


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


def commit_checkpoints(manager: CheckpointManager, n: int, committed: dict[int, float]) -> None:
    """The trainer: ``n`` small checkpoints 0.6-1.4 s apart (seeded), each commit's time into
    ``committed``; then ``FINAL``."""
    model = Model()
    rng = random.Random(0)
    time.sleep(1.0)
    for i in range(1, n + 1):
        model.step = i
        manager.save(i, {"trainer": model})
        committed[i] = time.time()
        time.sleep(rng.uniform(0.6, 1.4))
    manager.mark_final(n)
