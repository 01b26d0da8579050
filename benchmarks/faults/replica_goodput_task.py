"""The Task of the replica-group goodput benchmark (``benchmarks/faults/replica_goodput.py``), loaded by path
by every process of both its jobs (``cadence launch --replicas 2`` and ``cadence train --nproc 2``): the goodput
benchmarks' MLP and step time (:class:`~benchmarks.faults.goodput_task.GoodputTask`), which tells the benchmark
which process runs which replica group and rank, when it started and when its first step ended."""

from __future__ import annotations

import json
import os
from pathlib import Path

from goodput_task import NodeGoodputTask, _process_started, _write  # a sibling: cadence's loader puts this folder on sys.path


class ReplicaGoodputTask(NodeGoodputTask):
    """``attempt_dir``: each process writes ``worker-g<G>-r<R>-p<P>.json`` (``{"group", "rank", "pid",
    "started"}``: its replica group -- 0 outside fault-tolerant runs --, its rank in that group's job, its pid and
    the wall-clock time its process started) when it builds its data; ``steps-g<G>-r<R>-p<P>``, the train steps it
    has run (dropped ones included); and ``first-g<G>-r<R>-p<P>``, the wall-clock time its first train step ended
    (for a restarted group: the step it healed at, trained with the survivor)."""

    def _announce(self, ctx) -> Path:
        group = int(getattr(ctx, "replica_group", 0))
        self._name = f"g{group}-r{ctx.rank}-p{os.getpid()}"
        _write(self.attempt_dir / f"worker-{self._name}.json",
               json.dumps({"group": group, "rank": ctx.rank, "pid": os.getpid(), "started": _process_started()}))
        return self.attempt_dir / f"steps-{self._name}"
