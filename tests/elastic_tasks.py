"""The Task of the elastic-restart and hang tests (loaded by path: ``tests/elastic_tasks.py:ElasticTask``)
and of the goodput benchmark."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tasks import TinyTask


def block_forever(seconds: float = 3600.0) -> None:
    """Where the hung rank sits (the watchdog's report must show this frame)."""
    time.sleep(seconds)


class ElasticTask(TinyTask):
    """TinyTask that tells a test which processes run the current attempt of a torchrun job, and
    can hang one rank once.

    ``pid_dir``: each rank writes its pid to ``<pid_dir>/attempt<A>-rank<R>`` when it builds its
    training data, ``A`` being torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``).
    ``hang_rank`` / ``hang_at``: that rank's ``hang_at``-th train step of this process blocks for an
    hour, unless the file ``hang_marker`` exists (it is created first: the restarted job does not
    block again).
    """

    def __init__(self, attempt_dir: str | None = None, hang_rank: int | None = None, hang_at: int = 1,
                 hang_marker: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attempt_dir = attempt_dir
        self.hang_rank = hang_rank
        self.hang_at = hang_at
        self.hang_marker = hang_marker
        self.rank = int(os.environ.get("RANK", "0"))
        self.calls = 0

    def build_inputs(self, split, ctx):
        if split == "train" and self.attempt_dir is not None:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            path = Path(self.attempt_dir, f"attempt{attempt}-rank{ctx.rank}")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            tmp.replace(path)  # a reader never sees an empty file
        return super().build_inputs(split, ctx)

    def train_step(self, model, batch):
        self.calls += 1
        if self.rank == self.hang_rank and self.calls == self.hang_at and self.hang_marker is not None:
            marker = Path(self.hang_marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                block_forever()
        return super().train_step(model, batch)
