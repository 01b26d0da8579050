"""Is this output a new best? :class:`NewBestMetric` (Orbit's, persisted across restarts)."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from cadence.actions.metric_path import Metric, check_metric, get_metric, is_better, metric_name, same_metric
from cadence.actions.persisted import JSONPersistedValue, PersistedValueError

logger = logging.getLogger("cadence")

__all__ = ["NewBestMetric"]


class NewBestMetric:
    """A condition that holds when an output has a new best value of a metric.

    Two methods, both usable as actions or conditions: :meth:`test` only checks, :meth:`commit`
    checks and records. Calling the instance is :meth:`commit`. Keeping them apart lets the best
    be recorded only once the work it guards has succeeded (Orbit's pattern)::

        best = NewBestMetric("accuracy", filename=f"{model_dir}/best/best_metric.json")
        ConditionalAction(best.test, [export_best_model, best.commit])

    If the export fails or the process is preempted in between, the value is not recorded, so
    the next run exports again rather than believing a model it never wrote is the best.

    Comparison is strict: an equal value is not a new best. A non-finite value (NaN, +-inf) is
    never a new best. The first finite value is always a new best (:attr:`best_value` starts as
    None, not Orbit's ``-sys.float_info.max``).

    Where the best lives:

    * ``filename`` given: in that JSON file (a local path or fsspec URL), read at construction
      and rewritten atomically by each successful :meth:`commit` -- so a restarted run keeps its
      best and never calls a worse value a new best. **The file is the source of truth**: it is
      written at every new best, before any checkpoint can record that best, so
      :meth:`load_state_dict` ignores the checkpointed value whenever the file holds one (a
      checkpoint is older than the file: a run that crashed after committing a better value
      resumes from a checkpoint holding a worse one, and must keep the better). Only when the
      file holds no value yet (it did not exist) is the checkpointed value adopted, and written.
    * ``filename=None``: in memory; :meth:`state_dict` / :meth:`load_state_dict` carry it in
      checkpoints (the Controller saves and restores actions that have them).

    Args:
      metric: a key of the output, a nested key ``"a/b"``, or a callable ``output -> value``
        (see :func:`~cadence.actions.get_metric`).
      higher_is_better: True: a new best is strictly greater; False: strictly less.
      filename: the JSON file persisting the best value; None: memory (and checkpoints) only.
      write_metric: with a filename, whether this instance writes it (False: read it only, e.g. on
        all processes but one sharing the file).
      storage_options: passed to fsspec.

    Raises:
      PersistedValueError: the file exists and is corrupt, or holds something other than a
        number or null.
    """

    def __init__(
        self,
        metric: Metric,
        higher_is_better: bool = True,
        filename: str | None = None,
        write_metric: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.metric = metric
        self.higher_is_better = bool(higher_is_better)
        self._best = JSONPersistedValue(None, filename, write_value=write_metric, storage_options=storage_options)
        value = self._best.read()
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise PersistedValueError(
                f"the best-metric file {filename} holds {value!r:.200}, not a number or null"
            )

    def __call__(self, output: Mapping[str, Any]) -> bool:
        """Same as :meth:`commit`."""
        return self.commit(output)

    def __repr__(self) -> str:
        return (
            f"NewBestMetric({metric_name(self.metric)!r}, higher_is_better={self.higher_is_better}, "
            f"filename={self._best.filename!r}, best_value={self.best_value!r})"
        )

    @property
    def filename(self) -> str | None:
        return self._best.filename

    @property
    def best_value(self) -> float | None:
        """The best value recorded so far; None before the first :meth:`commit` of a finite value."""
        value = self._best.read()
        return None if value is None else float(value)

    def metric_value(self, output: Mapping[str, Any]) -> float:
        """The metric's value in ``output`` (a float); raises ``MetricNotFoundError`` if absent."""
        return get_metric(output, self.metric)

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """ConfigError when ``metrics`` hold no number under the metric (names the keys they hold)."""
        check_metric(metrics, self.metric, "NewBestMetric")

    def is_better(self, value: float) -> bool:
        """Whether ``value`` would be a new best (strictly better, finite)."""
        return is_better(value, self.best_value, higher_is_better=self.higher_is_better)

    def test(self, output: Mapping[str, Any]) -> bool:
        """Whether ``output`` holds a new best value. Records nothing: calling it again with the
        same output returns the same answer."""
        return self.is_better(self.metric_value(output))

    def commit(self, output: Mapping[str, Any]) -> bool:
        """Check ``output`` and, when it holds a new best value, record it (and write the file).

        Returns whether it was a new best; the same output committed twice is a new best once.
        """
        value = self.metric_value(output)
        if not self.is_better(value):
            return False
        self._best.write(value)
        return True

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"best_value", "metric", "higher_is_better"}`` (JSON); ``metric`` is None for a callable."""
        return {
            "best_value": self.best_value,
            "metric": self.metric if isinstance(self.metric, str) else None,
            "higher_is_better": self.higher_is_better,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the best value from a checkpoint (see the class doc for the file's precedence).

        A state saved for another metric name or the other direction is ignored, with a warning:
        its best value means nothing for this one.

        Raises:
          ValueError: ``state`` is not a mapping with a numeric or null ``best_value``.
        """
        if not isinstance(state, Mapping) or "best_value" not in state:
            raise ValueError(f"NewBestMetric.load_state_dict: expected a dict with 'best_value', got {state!r:.200}")
        value = state["best_value"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"NewBestMetric.load_state_dict: best_value must be a number or None, got {value!r:.200}")
        if not same_metric(state, self.metric, self.higher_is_better, "NewBestMetric"):
            return
        if value is None or not math.isfinite(value):
            return
        if self._best.filename is not None and self._best.read() is not None:
            if value != self._best.read():
                logger.info(
                    "NewBestMetric(%r): keeping the best value %r from %s over the checkpoint's %r",
                    metric_name(self.metric), self._best.read(), self._best.filename, value,
                )
            return
        self._best.write(float(value))

