"""Run actions only when a condition holds: :class:`ConditionalAction` (Orbit's)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from cadence.actions._wrapping import WrapperAction, run_all
from cadence.extensions import Action

__all__ = ["ConditionalAction", "Condition"]

Condition = Callable[[dict[str, Any]], Any]


class ConditionalAction(WrapperAction):
    """An action that runs ``action`` (one or a sequence) on an output when ``condition(output)``
    is truthy.

    Decouples *when* (the condition) from *what* (the actions)::

        best = NewBestMetric("accuracy", filename=...)
        ConditionalAction(best.test, [export_best, best.commit])

    Inner actions run in order; a :class:`~cadence.errors.StopTraining` from one does not skip the
    others (as in the Controller), and is raised once all have run. Other exceptions propagate at
    once.

    Whatever stands behind the condition and the actions (a bound method's instance, such as
    ``best`` above, or the callable itself) is :meth:`wrapped`: the Controller attaches and closes
    those objects as it does its own actions, and this action's state holds the stateful ones'
    (keyed by position and class name), so the Controller checkpoints e.g. a ``NewBestMetric``
    used only through ``best.test`` / ``best.commit``.

    Args:
      condition: a callable ``output -> truthy``.
      action: a callable ``output -> Any``, or a list / tuple of them.

    Raises:
      TypeError: ``condition`` or an action is not callable.
    """

    def __init__(self, condition: Condition, action: Action | Sequence[Action]) -> None:
        if not callable(condition):
            raise TypeError(f"ConditionalAction: condition must be callable, got {condition!r:.200}")
        super().__init__("ConditionalAction", action, condition)
        self.condition = condition
        self.action = action

    def __repr__(self) -> str:
        return f"ConditionalAction({self.condition!r}, {self.action!r})"

    def __call__(self, output: dict[str, Any]) -> None:
        if self.condition(output):
            run_all(self._actions, output)
