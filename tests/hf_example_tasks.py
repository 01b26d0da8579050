"""The hf_gpt2 example's Task (examples/hf_gpt2/task.py, loaded by its path under a name of its own)
slowed down for tests that kill a run mid-epoch: ``step_sleep`` seconds per step, and each process's
pid written to ``pid_dir/rank<N>`` (a torchrun rank runs in a session of its own)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from by_path import load_module

_PATH = Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2" / "task.py"
_NAME = "hf_gpt2_example_task"


class SlowGPT2Task(load_module(_NAME, _PATH).GPT2Task):
    def __init__(self, step_sleep: float = 0.0, pid_dir: str | None = None, **params) -> None:
        super().__init__(**params)
        if pid_dir is not None:
            Path(pid_dir, f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        self.step_sleep = step_sleep

    def train_step(self, model, batch):
        time.sleep(self.step_sleep)
        return super().train_step(model, batch)
