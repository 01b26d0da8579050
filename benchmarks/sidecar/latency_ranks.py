"""The sidecar latency benchmark's 2-rank row: the trainer and stamping evaluator of
:mod:`benchmarks.sidecar.stamping`, as the 1-process row's, with the real
:class:`~cadence.sidecar.evaluator.SidecarEvaluator` on 2 processes (gloo, CPU; spawned, a file
rendezvous): its chief watches, holds the lease, writes the log and broadcasts each step; both ranks
restore it (the files' verification shared, the ranks agreeing) before the evaluation starts. The
trainer thread runs in the chief's process; the latency is the chief's evaluation start minus the
commit.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading

from benchmarks.sidecar import stamping


def _rank(rank: int, world_size: int, tmp: str, n: int, poll_interval: float) -> None:
    import torch.distributed as dist

    from cadence import CheckpointManager
    from cadence.sidecar.evaluator import SidecarEvaluator
    from cadence.torch.runtime.distributed import TorchCoordinator

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        evaluator = stamping.StampingEvaluator()
        thread = None
        committed: dict[int, float] = {}
        if rank == 0:
            manager = CheckpointManager(f"{tmp}/run/checkpoints", max_to_keep=None)
            thread = threading.Thread(target=stamping.commit_checkpoints, args=(manager, n, committed))
            thread.start()
        SidecarEvaluator(evaluator, f"{tmp}/run", poll_interval=poll_interval, timeout=60,
                         coordinator=TorchCoordinator()).start()
        if thread is not None:
            thread.join()
            with open(f"{tmp}/latencies.json", "w") as f:
                json.dump([evaluator.started[s] - committed[s] for s in committed], f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def latencies(n: int, poll_interval: float, world_size: int = 2) -> list[float]:
    """Each checkpoint's seconds from its commit to the chief's evaluation start, on ``world_size`` ranks."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world_size, tmp, n, poll_interval), nprocs=world_size, start_method="spawn")
        with open(f"{tmp}/latencies.json") as f:
            return json.load(f)
