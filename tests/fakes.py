"""A fake trainer for tests of the framework-agnostic core (controller, actions, checkpoints).

Its "model" is ``value``, the sum of the steps taken, saved as ``model.bin``; ``data`` limits
how many steps the training data allows (None: endless).
"""

from __future__ import annotations

import json
from typing import Any, Callable

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


class SteppingTrainer(FakeTrainer):
    """A FakeTrainer that reports each step (``cadence.extensions.ReportsSteps``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_end: Callable[[int], None] | None = None
        self.on_step_end_calls = 0  # how many times set_step_end was called

    def set_step_end(self, fn: Callable[[int], None] | None) -> None:
        self.step_end = fn
        self.on_step_end_calls += 1

    def train(self, num_steps: int):
        step_end = self.step_end
        if step_end is not None:  # the step's own hook first, then the callbacks'
            steps = range(self.step + 1, self.step + num_steps + 1)
            self.on_step.update({n: _then(self.on_step.get(n), step_end, n) for n in steps})
        return super().train(num_steps)


def _then(first: Callable[[], None] | None, step_end: Callable[[int], None], step: int) -> Callable[[], None]:
    def both() -> None:
        if first is not None:
            first()
        step_end(step)

    return both


class Counter:
    """The smallest checkpointable object: ``value``, saved through ``state_dict`` / ``load_state_dict``."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
