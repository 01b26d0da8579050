"""The objects a run is made of: the actions and callbacks, with what wrappers wrap
(:func:`components`), and their :class:`~cadence.extensions.Stateful` members by checkpoint name."""

from __future__ import annotations

import inspect
from typing import Iterable, Sequence

from cadence.extensions import Composite, Stateful, checkpoint_name

__all__ = ["components", "owner_of", "stateful_members"]


def stateful_members(**groups: Sequence[object]) -> dict[str, object]:
    """The :class:`~cadence.extensions.Stateful` objects of each group, by checkpoint name:
    ``"<group>/<position>/<name>"`` with ``name`` the object's ``checkpoint_name`` when set, else
    its class name (``train_actions/1/EarlyStopping``)."""
    found: dict[str, object] = {}
    for group, members in groups.items():
        for i, obj in enumerate(members):
            if isinstance(obj, Stateful):
                found[f"{group}/{i}/{checkpoint_name(obj)}"] = obj
    return found


def owner_of(fn: object) -> object:
    """The object behind a callable: a bound method's instance (``best.test`` stands for
    ``best``), else the callable itself."""
    return fn.__self__ if inspect.ismethod(fn) else fn


def components(objects: Iterable[object]) -> list[object]:
    """``objects`` and, depth first after each :class:`~cadence.extensions.Composite`, what it
    wraps: the owners of bound methods, each object once (by identity), in order."""
    found: list[object] = []

    def visit(obj: object) -> None:
        obj = owner_of(obj)
        if any(obj is seen for seen in found):
            return
        found.append(obj)
        if isinstance(obj, Composite):
            for inner in obj.wrapped():
                visit(inner)

    for obj in objects:
        visit(obj)
    return found
