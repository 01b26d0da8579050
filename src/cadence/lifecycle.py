"""The declared extension points of a run: what actions and callbacks may use, and what they may be.

An *action* is any callable ``action(output: dict) -> Any`` (Orbit's contract). An action or a
:class:`~cadence.callbacks.Callback` takes part in the run's life cycle by being an instance of
the protocols below -- declared here, once, and looked at by the :class:`~cadence.Controller` in
one place (:func:`components`), never probed for one optional method at a time:

* :class:`RunAware` -- ``attach(run)``: handed the :class:`RunContext` once, when the controller is
  built, before the checkpoint is restored.
* :class:`~cadence.checkpoint.Stateful` -- ``state_dict()`` / ``load_state_dict()`` (JSON): saved
  in every checkpoint under the object's position and restored with it.
* :class:`Closeable` -- ``close()``: called once by ``Controller.close()`` (e.g. to put signal
  handlers back).
* :class:`Composite` -- ``wrapped()``: an action that runs other actions
  (:class:`~cadence.actions.ConditionalAction`, :class:`~cadence.actions.PeriodicAction`). The
  controller attaches and closes what it wraps as it does the top-level objects, so a wrapper
  forwards nothing by hand; the wrapped objects' *state* is the wrapper's to save (it is part of
  the wrapper's ``state_dict``), so the checkpoint layout does not depend on how deep they sit.
* :class:`ChecksOutputs` -- ``check_outputs(metrics)``: an eval action that reads metrics by
  name checks, before training, that the evaluation's outputs hold them (the sanity check,
  :func:`cadence.loop.sanity.sanity_check`), so a misnamed metric fails before any step is trained.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from cadence.checkpoint import CheckpointManager
    from cadence.runtime.coordination import Coordinator
    from cadence.loop.runner import Evaluator, Trainer

__all__ = ["Action", "ChecksOutputs", "Closeable", "Composite", "RunAware", "RunContext", "components", "owner_of",
           "stateful_members"]

Action = Callable[[dict[str, Any]], Any]


class RunContext(Protocol):
    """What an action or a callback may use of the run it belongs to (the
    :class:`~cadence.Controller` is one). Read the step and rank facts; act through the methods."""

    @property
    def global_step(self) -> int:
        """The current global step (the trainer's; without one, the restored checkpoint's)."""
        ...

    @property
    def restored_step(self) -> int | None:
        """The step restored on construction; None before the restore or when none was."""
        ...

    @property
    def coordinator(self) -> Coordinator:
        """Rank facts (``rank``, ``world_size``, ``is_chief``) and the ranks' collectives."""
        ...

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The run's checkpoints (None: the run saves none)."""
        ...

    @property
    def trainer(self) -> Trainer | None:
        """The trainer (None: an evaluation-only run)."""
        ...

    @property
    def evaluator(self) -> Evaluator | None:
        """The evaluator (None: a training-only run)."""
        ...

    def save_checkpoint(self) -> str | None:
        """Collective: commit a checkpoint at the current step; its path (None: no manager)."""
        ...

    def rollback(self) -> int:
        """Collective: restore the model state of the latest checkpoint, keeping the data moving
        forward; the step rolled back to. Raises ``CheckpointError`` without one."""
        ...

    def request_stop(self, reason: str) -> None:
        """End training cleanly at the end of this inner loop (as raising ``StopTraining`` does)."""
        ...

    def prepare_checkpoint(self) -> None:
        """Collective: let the trainer gather from every rank what the chief saves."""
        ...

    def checkpoint_objects(self) -> dict[str, object]:
        """What a checkpoint of this run holds, by name (for actions that save elsewhere)."""
        ...


@runtime_checkable
class RunAware(Protocol):
    """Handed the run once, when the controller is built (before the restore)."""

    def attach(self, run: RunContext) -> None: ...


@runtime_checkable
class Closeable(Protocol):
    """Closed once, by ``Controller.close()``."""

    def close(self) -> None: ...


@runtime_checkable
class Composite(Protocol):
    """An action that runs other actions: :meth:`wrapped` names them (and its condition's owner)."""

    def wrapped(self) -> Sequence[object]: ...


@runtime_checkable
class ChecksOutputs(Protocol):
    """An eval action that needs something in the evaluation's metrics (a metric by name)."""

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """Raise :class:`~cadence.errors.ConfigError` (or another
        :class:`~cadence.errors.CadenceError`) when this action could not run on ``metrics``: the
        message names what is missing and what the metrics hold. Changes nothing."""
        ...


def stateful_members(**groups: Sequence[object]) -> dict[str, object]:
    """The :class:`~cadence.checkpoint.Stateful` objects of each group, by checkpoint name:
    ``"<group>/<position>/<name>"`` with ``name`` the object's ``checkpoint_name`` when set, else
    its class name (``train_actions/1/EarlyStopping``)."""
    from cadence.checkpoint.protocol import Stateful

    found: dict[str, object] = {}
    for group, members in groups.items():
        for i, obj in enumerate(members):
            if isinstance(obj, Stateful):
                name = getattr(obj, "checkpoint_name", None) or type(obj).__name__
                found[f"{group}/{i}/{name}"] = obj
    return found


def owner_of(fn: object) -> object:
    """The object behind a callable: a bound method's instance (``best.test`` stands for
    ``best``), else the callable itself."""
    return fn.__self__ if inspect.ismethod(fn) else fn


def components(objects: Iterable[object]) -> list[object]:
    """``objects`` and, depth first after each :class:`Composite`, what it wraps: the owners of
    bound methods, each object once (by identity), in order."""
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
