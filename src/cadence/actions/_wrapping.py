"""What actions that wrap other actions share: calling them, forwarding ``attach`` and state."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

from cadence.errors import StopTraining

logger = logging.getLogger("cadence")

Action = Callable[[dict[str, Any]], Any]


def as_list(action: Action | Sequence[Action], owner: str) -> list[Action]:
    """One action or a sequence of them, as a list; each must be callable."""
    actions = list(action) if isinstance(action, (list, tuple)) else [action]
    for a in actions:
        if not callable(a):
            raise TypeError(f"{owner}: actions must be callables, got {a!r:.200}")
    return actions


def owners(*callables: object) -> list[object]:
    """The objects behind ``callables`` (a bound method's instance, else the callable itself),
    without repeats. ``best.test`` and ``best.commit`` both stand for ``best``."""
    found: list[object] = []
    for c in callables:
        obj = c.__self__ if inspect.ismethod(c) else c
        if not any(obj is seen for seen in found):
            found.append(obj)
    return found


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


def attach_all(targets: list[object], controller: Any) -> None:
    for obj in targets:
        attach = getattr(obj, "attach", None)
        if callable(attach):
            attach(controller)


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _key(i: int, obj: object) -> str:
    return f"{i}/{getattr(obj, 'checkpoint_name', None) or type(obj).__name__}"


def state_of(targets: list[object]) -> dict[str, Any]:
    """The inner stateful objects' states, keyed ``"<position>/<class name>"``."""
    return {_key(i, obj): obj.state_dict() for i, obj in enumerate(targets) if _stateful(obj)}  # type: ignore[attr-defined]


def load_state_of(targets: list[object], state: Mapping[str, Any], owner: str) -> None:
    """Give each inner stateful object its saved state; those without one are left as they are."""
    for i, obj in enumerate(targets):
        if not _stateful(obj):
            continue
        key = _key(i, obj)
        if key in state:
            obj.load_state_dict(state[key])  # type: ignore[attr-defined]
        else:
            logger.debug("%s: no saved state for inner action %s; left as is", owner, key)
