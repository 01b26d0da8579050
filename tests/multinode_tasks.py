"""The Task of the multi-node tests (loaded by path: ``tests/multinode_tasks.py:NodeTask``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tasks import TinyTask


class NodeTask(TinyTask):
    """TinyTask that tells a test where each rank of each attempt of a multi-node torchrun job runs:
    when a rank builds its training data it writes ``<attempt_dir>/attempt<A>-node<N>.json``, ``{"rank",
    "pid", "agent"}`` (``A``: torchrun's restart count; ``N``: the node, ``$CADENCE_NODE_RANK``; ``agent``:
    the pid of the torchrun agent that started it, ``$CADENCE_TORCHRUN_AGENT``)."""

    def __init__(self, attempt_dir: str, hold_after: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attempt_dir = attempt_dir
        self.hold_after = hold_after
        self.steps_here = 0

    def train_step(self, model, batch):
        """With ``hold_after`` N: the N+1st step this process runs waits until ``<attempt_dir>/release`` exists,
        so that a test acts mid-run however slow the machine (a worker started after the release goes on)."""
        self.steps_here += 1
        if self.hold_after is not None and self.steps_here > self.hold_after:
            release = Path(self.attempt_dir, "release")
            while not release.exists():
                time.sleep(0.01)
        return super().train_step(model, batch)

    def build_inputs(self, split, ctx):
        if split == "train":
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            path = Path(self.attempt_dir, f"attempt{attempt}-node{os.environ.get('CADENCE_NODE_RANK', '?')}.json")
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"rank": ctx.rank, "pid": os.getpid(),
                                       "agent": int(os.environ.get("CADENCE_TORCHRUN_AGENT", "0") or 0)}))
            tmp.replace(path)  # a reader never sees a partial file
        return super().build_inputs(split, ctx)
