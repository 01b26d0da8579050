"""NaN / loss-spike recovery (TF Model Garden's ``RecoveryCondition`` + ``RecoveryAction``)."""

from __future__ import annotations

import logging
import math
from typing import Any

from cadence.errors import CheckpointError, TrainingDivergedError
from cadence.extensions import RunContext

logger = logging.getLogger("cadence.actions")


class RecoveryAction:
    """A train action that rolls training back when the loss diverges.

    The loss (``output[loss_key]``, the inner loop's mean) has diverged when it is NaN or
    infinite, or when ``loss_upper_bound`` is set, the global step is at least
    ``recovery_begin_steps`` and the loss exceeds the bound. Then model, optimizer, scheduler,
    grad scaler and global step are restored from the latest committed checkpoint through
    :meth:`~cadence.extensions.RunContext.rollback`, while the data position keeps moving forward: the batches
    of the steps since that checkpoint are skipped (as large-model practice does for loss spikes)
    and the skipped range is logged and kept in :attr:`skipped`.

    Args:
      loss_upper_bound: a finite loss above this is a divergence too. ``None``: only NaN/inf.
      recovery_begin_steps: the bound applies from this global step on (NaN/inf always count).
      max_trials: recoveries allowed over the whole run; the next divergence raises
        :class:`~cadence.errors.TrainingDivergedError`. ``0``: fail at the first divergence.
      loss_key: the key of the loss in the train loop's output.

    The number of recoveries and the skipped ranges are checkpointed, so ``max_trials`` counts
    across restarts. A divergence before the first committed checkpoint has nothing to roll back
    to and raises :class:`~cadence.errors.TrainingDivergedError`.
    """

    checkpoint_name = "recovery"

    def __init__(
        self,
        loss_upper_bound: float | None = None,
        recovery_begin_steps: int = 0,
        max_trials: int = 3,
        loss_key: str = "loss",
    ) -> None:
        if max_trials < 0:
            raise ValueError(f"max_trials must be >= 0, got {max_trials}")
        if recovery_begin_steps < 0:
            raise ValueError(f"recovery_begin_steps must be >= 0, got {recovery_begin_steps}")
        self.loss_upper_bound = loss_upper_bound
        self.recovery_begin_steps = recovery_begin_steps
        self.max_trials = max_trials
        self.loss_key = loss_key
        self.trials = 0
        self.skipped: list[tuple[int, int]] = []
        self._run: RunContext | None = None

    def attach(self, run: RunContext) -> None:
        self._run = run

    def diverged(self, loss: float, step: int) -> bool:
        """Whether ``loss`` at global step ``step`` calls for a recovery."""
        if not math.isfinite(loss):
            return True
        return (
            self.loss_upper_bound is not None
            and step >= self.recovery_begin_steps
            and loss > self.loss_upper_bound
        )

    def __call__(self, output: dict[str, Any]) -> None:
        run = self._run
        if run is None:
            raise RuntimeError("RecoveryAction must be attached to a Controller (pass it in train_actions)")
        if self.loss_key not in output:
            raise KeyError(f"RecoveryAction: no {self.loss_key!r} in the train output; it has {sorted(output)}")
        loss = float(output[self.loss_key])
        step = run.global_step
        diverged = self.diverged(loss, step)
        if run.coordinator.world_size > 1:
            diverged = run.coordinator.any(diverged)  # every rank rolls back together
        if not diverged:
            return
        if self.trials >= self.max_trials:
            raise TrainingDivergedError(
                f"loss {loss} at step {step} after {self.trials} recoveries (max_trials={self.max_trials}); "
                f"steps skipped so far: {self._ranges()}"
            )
        try:
            to = run.rollback()
        except CheckpointError as e:
            raise TrainingDivergedError(f"loss {loss} at step {step} and {e}") from e
        self.trials += 1
        self.skipped.append((to + 1, step))
        logger.warning(
            "loss %s at step %d: rolled back to the checkpoint at step %d (recovery %d of %d); "
            "the batches of steps %d-%d are skipped",
            loss, step, to, self.trials, self.max_trials, to + 1, step,
        )

    def _ranges(self) -> str:
        return ", ".join(f"{a}-{b}" for a, b in self.skipped) or "none"

    def state_dict(self) -> dict[str, Any]:
        return {"trials": self.trials, "skipped": [list(r) for r in self.skipped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trials = int(state["trials"])
        self.skipped = [(int(a), int(b)) for a, b in state["skipped"]]
