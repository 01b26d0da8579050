"""Stop training when a metric stops improving: :class:`EarlyStopping`."""

from __future__ import annotations

import math
from typing import Any, Mapping

from cadence.actions.metric_path import Metric, check_metric, get_metric, is_better, metric_name, same_metric
from cadence.errors import StopTraining
from cadence.extensions import RunContext

__all__ = ["EarlyStopping"]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"EarlyStopping: {name} must be a finite number, got {value!r}")
    return float(value)


class EarlyStopping:
    """An eval action that raises :class:`~cadence.errors.StopTraining` when ``metric`` has not
    improved for ``patience`` evaluations in a row.

    An evaluation *improves* when its value beats the reference by more than ``min_delta``:
    ``value > reference + min_delta`` (``higher_is_better``) or ``value < reference - min_delta``.
    The reference is the best value so far, or ``baseline`` until some value has beaten it; with
    neither (the first evaluation, no baseline), any finite value improves. An improvement
    becomes the best and resets the count; anything else -- including NaN or an infinite value --
    adds one. When the count reaches ``patience`` the action raises ``StopTraining``, its reason
    naming the metric, the best value and the step it was reached at (when attached to a
    controller, see :meth:`attach`). Each further evaluation without improvement raises again.

    The best only moves on an improvement greater than ``min_delta``, so a metric creeping up by
    less than ``min_delta`` per evaluation still runs out of patience (Keras' rule).

    :meth:`state_dict` / :meth:`load_state_dict` carry the best value, its step and the count, so
    a resumed run stops at the same evaluation as an uninterrupted one.

    Args:
      metric: a key of the eval output, a nested key ``"a/b"``, or a callable ``output -> value``
        (see :func:`~cadence.actions.get_metric`).
      patience: evaluations without improvement that stop training; an int >= 1.
      min_delta: the margin an improvement must exceed; a finite number >= 0.
      higher_is_better: the direction of improvement.
      baseline: a value to beat before anything counts as an improvement; ``None``: none.

    Raises:
      ValueError: invalid ``patience`` / ``min_delta`` / ``baseline``.
      MetricNotFoundError: (on call) the metric is not in the output.
    """

    def __init__(
        self,
        metric: Metric,
        patience: int,
        min_delta: float = 0.0,
        higher_is_better: bool = True,
        baseline: float | None = None,
    ) -> None:
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}")
        min_delta = _number("min_delta", min_delta)
        if min_delta < 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.metric = metric
        self.patience = patience
        self.min_delta = min_delta
        self.higher_is_better = bool(higher_is_better)
        self.baseline = None if baseline is None else _number("baseline", baseline)
        self._run: RunContext | None = None
        self._best: float | None = None
        self._best_step: int | None = None
        self._wait = 0

    def __repr__(self) -> str:
        return (
            f"EarlyStopping({metric_name(self.metric)!r}, patience={self.patience}, "
            f"min_delta={self.min_delta}, higher_is_better={self.higher_is_better}, "
            f"baseline={self.baseline}, best_value={self._best}, wait={self._wait})"
        )

    @property
    def best_value(self) -> float | None:
        """The best value so far (None before the first improvement)."""
        return self._best

    @property
    def best_step(self) -> int | None:
        """The global step of the best value (None when unknown or not attached)."""
        return self._best_step

    @property
    def wait(self) -> int:
        """Evaluations since the last improvement."""
        return self._wait

    def attach(self, run: RunContext) -> None:
        """Read ``run.global_step`` to record the step of the best value."""
        self._run = run

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """ConfigError when ``metrics`` hold no number under the metric (names the keys they hold)."""
        check_metric(metrics, self.metric, "EarlyStopping")

    def improves(self, value: float) -> bool:
        """Whether ``value`` would count as an improvement now."""
        reference = self._best if self._best is not None else self.baseline
        return is_better(value, reference, higher_is_better=self.higher_is_better, min_delta=self.min_delta)

    def __call__(self, output: Mapping[str, Any]) -> None:
        value = get_metric(output, self.metric)
        if self.improves(value):
            self._best = value
            self._best_step = self._step()
            self._wait = 0
            return
        self._wait += 1
        if self._wait >= self.patience:
            raise StopTraining(self._reason())

    def _step(self) -> int | None:
        return None if self._run is None else int(self._run.global_step)

    def _reason(self) -> str:
        name = metric_name(self.metric)
        better = "increased" if self.higher_is_better else "decreased"
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        if self._best is None:
            best = "no value improved" + (f" on the baseline {self.baseline:g}" if self.baseline is not None else "")
        else:
            best = f"best {name}={self._best:g}" + (f" at step {self._best_step}" if self._best_step is not None else "")
        step = self._step()
        at = f" (step {step})" if step is not None else ""
        return f"early stopping: {name} has not {better}{by} for {self._wait} evaluations{at}; {best}"

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"best_value", "best_step", "wait", "metric", "higher_is_better"}`` (JSON)."""
        return {
            "best_value": self._best,
            "best_step": self._best_step,
            "wait": self._wait,
            "metric": self.metric if isinstance(self.metric, str) else None,
            "higher_is_better": self.higher_is_better,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpointed state. A state saved for another metric name or the other
        direction is ignored, with a warning.

        Raises:
          ValueError: a malformed state.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"EarlyStopping.load_state_dict: expected a dict, got {state!r:.200}")
        best, best_step, wait = state.get("best_value"), state.get("best_step"), state.get("wait", 0)
        if best is not None:
            best = _number("best_value (from the checkpoint)", best)
        if best_step is not None and (not isinstance(best_step, int) or isinstance(best_step, bool)):
            raise ValueError(f"EarlyStopping.load_state_dict: best_step must be an int or None, got {best_step!r}")
        if not isinstance(wait, int) or isinstance(wait, bool) or wait < 0:
            raise ValueError(f"EarlyStopping.load_state_dict: wait must be an int >= 0, got {wait!r}")
        if not same_metric(state, self.metric, self.higher_is_better, "EarlyStopping"):
            return
        self._best, self._best_step, self._wait = best, best_step, wait
