"""A fake trainer for tests of the framework-agnostic core (controller, actions, checkpoints).

Its "model" is ``value``, the sum of the steps taken, saved as ``model.bin``; ``data`` limits
how many steps the training data allows (None: endless).
"""

from __future__ import annotations

import json
from typing import Callable

MODEL_FILE = "model.bin"


class FakeTrainer:
    """Counts steps. ``on_step[n]`` runs when the step reaches n; ``on_save[n]`` runs while the
    checkpoint at step n is being written (after its model file, before its second file)."""

    def __init__(self, data: int | None = None, on_step: dict[int, Callable[[], None]] | None = None,
                 on_save: dict[int, Callable[[], None]] | None = None) -> None:
        self.step = 0
        self.value = 0
        self.data = data
        self.on_step = dict(on_step or {})
        self.on_save = dict(on_save or {})
        self.requests: list[int] = []
        self.saves: list[int] = []
        self.initialized = 0

    @property
    def global_step(self) -> int:
        return self.step

    def train(self, num_steps: int):
        self.requests.append(num_steps)
        n = num_steps if self.data is None else max(0, min(num_steps, self.data - self.step))
        for _ in range(n):
            self.step += 1
            self.value += self.step
            hook = self.on_step.pop(self.step, None)
            if hook is not None:
                hook()
        return {"loss": 1.0 / self.step if self.step else 0.0}

    def initialize(self) -> None:
        self.initialized += 1

    def model_bytes(self) -> bytes:
        return json.dumps({"step": self.step, "value": self.value}).encode()

    def save_checkpoint(self, writer):
        writer.write(MODEL_FILE, self.model_bytes())
        hook = self.on_save.pop(self.step, None)
        if hook is not None:
            hook()
        writer.write("extra.bin", json.dumps(self.step).encode())
        self.saves.append(self.step)
        return {"global_step": self.step}

    def load_checkpoint(self, reader, state):
        model = json.loads(reader.read(MODEL_FILE))
        self.step, self.value = model["step"], model["value"]
        assert state["global_step"] == self.step
