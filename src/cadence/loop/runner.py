"""The two roles the :class:`~cadence.Controller` drives: a trainer and an evaluator.

Both are plain protocols (Orbit's ``AbstractTrainer`` / ``AbstractEvaluator``): the controller
never imports a framework. ``cadence.torch`` ships implementations for PyTorch; tests use fakes.

Optional capabilities, each a declared protocol checked with ``isinstance``:

* :class:`Initializable` (``initialize()``) -- called once by the controller when no checkpoint
  was restored (a fresh start): load pretrained weights and the like.
* :class:`~cadence.checkpoint.Checkpointable` (``save_checkpoint(writer)`` /
  ``load_checkpoint(reader, state)``) -- a trainer that is one is saved and restored by the
  controller's checkpoint manager; an evaluator-only controller restores the evaluator.
* :class:`GathersCheckpoint` (``prepare_checkpoint()``) -- a collective called on every rank
  before each save, to gather what the chief writes (e.g. each rank's RNG state).
* :class:`~cadence.summaries.throughput.CountsWork` (``loop_work()``) -- a trainer that says what its last
  ``train()`` call processed (samples, tokens, FLOPs): the controller logs the rates.
* :class:`~cadence.checkpoint.protocol.WritesShards` -- a trainer whose ranks each write their
  shards of a checkpoint.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

Logs = Mapping[str, Any]

__all__ = ["Evaluator", "GathersCheckpoint", "Initializable", "Logs", "Trainer"]


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


@runtime_checkable
class Initializable(Protocol):
    """A runner with work to do on a fresh start (no checkpoint restored)."""

    def initialize(self) -> None: ...


@runtime_checkable
class GathersCheckpoint(Protocol):
    """A trainer that gathers state from every rank before a save (a collective)."""

    def prepare_checkpoint(self) -> None: ...
