"""Sidecar latency: seconds from a checkpoint's commit (its manifest written) to the sidecar
starting to evaluate it, with the default ``poll_interval`` (0.5 s).

A trainer thread commits small checkpoints at irregular intervals (so commits do not phase-lock
with the polling); the real :class:`~cadence.sidecar.evaluator.SidecarEvaluator` runs in the main thread
with leases, the evaluation log and verification, and an evaluator that records when each
evaluation starts.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading

from benchmarks.sidecar.stamping import StampingEvaluator, commit_checkpoints
from cadence import CheckpointManager
from cadence.sidecar.evaluator import SidecarEvaluator

N = 20


def _stats(latencies: list[float]) -> dict:
    latencies = sorted(latencies)
    p95 = latencies[max(0, round(0.95 * len(latencies)) - 1)]
    return {"median_s": statistics.median(latencies), "p95_s": p95, "max_s": latencies[-1]}


def run(n: int = N, poll_interval: float = 0.5) -> dict:
    """One sidecar process, then a sidecar of 2 ranks (``ranks2``: :mod:`benchmarks.sidecar.latency_ranks`)."""
    from benchmarks.sidecar import latency_ranks

    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(f"{tmp}/checkpoints", max_to_keep=None)
        committed: dict[int, float] = {}
        thread = threading.Thread(target=commit_checkpoints, args=(manager, n, committed))
        thread.start()
        evaluator = StampingEvaluator()
        SidecarEvaluator(evaluator, tmp, poll_interval=poll_interval, timeout=60).start()
        thread.join()
    one = _stats([evaluator.started[s] - committed[s] for s in committed])
    return {"checkpoints": n, "poll_interval_s": poll_interval, **one, "target": "median <= 1 s",
            "ranks2": _stats(latency_ranks.latencies(n, poll_interval))}


def markdown_lines(r: dict) -> list[str]:
    """The table of :func:`run`'s result ``r``."""
    rows = [("1 process", r)] + ([("2 ranks (gloo)", r["ranks2"])] if "ranks2" in r else [])
    return [(f"## Sidecar latency (commit → evaluation starts, {r['checkpoints']} checkpoints, "
             f"poll {r['poll_interval_s']} s)\n"),
            "| sidecar | median s | p95 s | max s |", "|---|---|---|---|",
            *[f"| {name} | {x['median_s']:.3f} | {x['p95_s']:.3f} | {x['max_s']:.3f} |" for name, x in rows],
            f"\nTarget: {r['target']}.\n"]


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
