"""The two roles the :class:`~cadence.Controller` drives: a trainer and an evaluator.

Both are plain protocols (Orbit's ``AbstractTrainer`` / ``AbstractEvaluator``): the controller
never imports a framework. ``cadence.torch`` ships implementations for PyTorch; tests use fakes.

Optional methods, looked up with ``getattr``:

* ``initialize()`` -- called once by the controller when no checkpoint was restored (a fresh
  start): load pretrained weights and the like.
* ``save_checkpoint(writer) -> JSON | None`` and ``load_checkpoint(reader, state)`` -- see
  :class:`cadence.checkpoint.Checkpointable`. A trainer that has them is saved and restored by
  the controller's checkpoint manager; an evaluator-only controller restores the evaluator.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

Logs = Mapping[str, Any]


@runtime_checkable
class Trainer(Protocol):
    """Runs training steps and owns the global step."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints)."""
        ...

    def train(self, num_steps: int) -> Logs | None:
        """Run up to ``num_steps`` steps; return the loop's logs (e.g. mean ``loss``).

        Returning after fewer steps means the training data is exhausted; the controller checks
        ``global_step`` to see how far it got.
        """
        ...


@runtime_checkable
class Evaluator(Protocol):
    """Evaluates the current model state."""

    def evaluate(self, num_steps: int) -> Logs | None:
        """Evaluate ``num_steps`` batches (``-1``: until the eval data is exhausted); return metrics."""
        ...
