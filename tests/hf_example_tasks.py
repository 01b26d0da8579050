"""The hf_gpt2 example's Task (examples/hf_gpt2/task.py, loaded by its path under a name of its own)
slowed down for tests that kill a run mid-epoch: ``step_sleep`` seconds per step, and each process's
pid written to ``pid_dir/rank<N>`` (a torchrun rank runs in a session of its own)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2" / "task.py"
_NAME = "hf_gpt2_example_task"


def _example():
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, _PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


class SlowGPT2Task(_example().GPT2Task):
    def __init__(self, step_sleep: float = 0.0, pid_dir: str | None = None, **params) -> None:
        super().__init__(**params)
        if pid_dir is not None:
            Path(pid_dir, f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        self.step_sleep = step_sleep

    def train_step(self, model, batch):
        time.sleep(self.step_sleep)
        return super().train_step(model, batch)
