"""What actions that wrap other actions share: :class:`WrapperAction`.

A wrapper declares what it wraps (:meth:`WrapperAction.wrapped`, the
:class:`~cadence.extensions.Composite` protocol): the controller attaches and closes those objects
itself, so no wrapper forwards ``attach`` or ``close``. The wrapped objects' state is carried in
the wrapper's own ``state_dict`` (keyed by position and class name), written here once.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from cadence.errors import StopTraining
from cadence.extensions import Action, Stateful, checkpoint_name
from cadence.loop.members import owner_of

logger = logging.getLogger("cadence")


def as_list(action: Action | Sequence[Action], owner: str) -> list[Action]:
    """One action or a sequence of them, as a list; each must be callable."""
    actions: list[Action] = list(action) if isinstance(action, (list, tuple)) else [action]  # type: ignore[list-item]
    for a in actions:
        if not callable(a):
            raise TypeError(f"{owner}: actions must be callables, got {a!r:.200}")
    return actions


def run_all(actions: list[Action], output: dict[str, Any]) -> None:
    """Call each action with ``output``, as the Controller does: a :class:`StopTraining` from one
    does not skip the others; the first is re-raised once all have run."""
    stop: StopTraining | None = None
    for action in actions:
        try:
            action(output)
        except StopTraining as e:
            stop = stop or e
    if stop is not None:
        raise stop


def _key(i: int, obj: object) -> str:
    return f"{i}/{checkpoint_name(obj)}"


class WrapperAction:
    """Base of actions that run other actions: :meth:`wrapped` and the inner objects' state.

    Args:
      owner: the wrapper's name, for messages.
      action: a callable ``output -> Any`` or a list / tuple of them.
      extra: other callables whose owners belong to the wrapper (a condition).
    """

    def __init__(self, owner: str, action: Action | Sequence[Action], *extra: object) -> None:
        self._actions = as_list(action, owner)
        self._targets: list[object] = []
        for fn in (*extra, *self._actions):
            obj = owner_of(fn)
            if not any(obj is seen for seen in self._targets):
                self._targets.append(obj)

    def wrapped(self) -> list[object]:
        """The objects behind the wrapped callables (a bound method's instance, else the callable),
        without repeats: the controller attaches and closes them."""
        return list(self._targets)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped stateful objects' states, keyed ``"<position>/<class name>"``."""
        return {_key(i, obj): obj.state_dict() for i, obj in enumerate(self._targets) if isinstance(obj, Stateful)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give each wrapped stateful object its saved state; one without a saved state is left as is."""
        for i, obj in enumerate(self._targets):
            if not isinstance(obj, Stateful):
                continue
            key = _key(i, obj)
            if key in state:
                obj.load_state_dict(state[key])
            else:
                logger.debug("%s: no saved state for inner action %s; left as is", type(self).__name__, key)
