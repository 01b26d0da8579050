"""Run actions only when a condition holds: :class:`ConditionalAction` (Orbit's)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from cadence.actions import _wrapping
from cadence.actions._wrapping import Action

__all__ = ["ConditionalAction", "Condition"]

Condition = Callable[[dict[str, Any]], Any]


class ConditionalAction:
    """An action that runs ``action`` (one or a sequence) on an output when ``condition(output)``
    is truthy.

    Decouples *when* (the condition) from *what* (the actions)::

        best = NewBestMetric("accuracy", filename=...)
        ConditionalAction(best.test, [export_best, best.commit])

    Inner actions run in order; a :class:`~cadence.errors.StopTraining` from one does not skip the
    others (as in the Controller), and is raised once all have run. Other exceptions propagate at
    once.

    Whatever stands behind the condition and the actions (a bound method's instance, such as
    ``best`` above, or the callable itself) is forwarded:

    * ``attach(controller)``, to those that define it;
    * ``state_dict()`` / ``load_state_dict()``, for those that define both: this action's state
      holds theirs (keyed by position and class name), so the Controller checkpoints e.g. a
      ``NewBestMetric`` used only through ``best.test`` / ``best.commit``.

    Args:
      condition: a callable ``output -> truthy``.
      action: a callable ``output -> Any``, or a list / tuple of them.

    Raises:
      TypeError: ``condition`` or an action is not callable.
    """

    def __init__(self, condition: Condition, action: Action | Sequence[Action]) -> None:
        if not callable(condition):
            raise TypeError(f"ConditionalAction: condition must be callable, got {condition!r:.200}")
        self.condition = condition
        self.action = action
        self._actions = _wrapping.as_list(action, "ConditionalAction")
        self._targets = _wrapping.owners(condition, *self._actions)

    def __repr__(self) -> str:
        return f"ConditionalAction({self.condition!r}, {self.action!r})"

    def attach(self, controller: Any) -> None:
        """Forward ``attach(controller)`` to the condition's and actions' owners that have it."""
        _wrapping.attach_all(self._targets, controller)

    def __call__(self, output: dict[str, Any]) -> None:
        if self.condition(output):
            _wrapping.run_all(self._actions, output)

    def state_dict(self) -> dict[str, Any]:
        """The states of the stateful objects behind the condition and actions."""
        return _wrapping.state_of(self._targets)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _wrapping.load_state_of(self._targets, state, "ConditionalAction")
