"""Run actions every N global steps: :class:`PeriodicAction`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from cadence.actions import _wrapping
from cadence.actions._wrapping import Action

__all__ = ["PeriodicAction"]


class PeriodicAction:
    """Runs ``action`` (one or a sequence) when the global step has crossed a multiple of
    ``every_n_steps`` since this action was last called.

    Crossing, not landing: with inner loops ending at steps 3, 6, 9, 12 and ``every_n_steps=5``,
    the actions run at 6 (5 was crossed) and 12 (10 was crossed). Several multiples crossed in one
    loop run the actions once. Every call, run or not, moves the reference step forward; a global
    step that went back (a rollback) becomes the new reference, so the rolled-back multiples are
    crossed -- and acted on -- again.

    The first reference step is not 0 but, in order of precedence: the reference restored from
    this action's own checkpointed state (:meth:`load_state_dict`); else the step of the
    checkpoint the controller restored (its ``restored_step``); else the global step at
    :meth:`attach` time. So a resumed run does not act again for a multiple that the run before it
    already handled (the checkpointed reference matters for eval actions, which are called less
    often than checkpoints are saved), and a run starting from a non-zero step does not act at
    once. The Controller attaches actions *before* restoring, which is why the restored step is
    read at the first call rather than at attach time.

    ``attach`` is forwarded, and inner stateful objects' states are carried, as in
    :class:`~cadence.actions.ConditionalAction`.

    Args:
      action: a callable ``output -> Any``, or a list / tuple of them.
      every_n_steps: an int >= 1.

    Raises:
      ValueError: ``every_n_steps`` is not an int >= 1.
      TypeError: an action is not callable.
      RuntimeError: (on call) the action was not attached to a controller.
    """

    def __init__(self, action: Action | Sequence[Action], every_n_steps: int) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"PeriodicAction: every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.action = action
        self.every_n_steps = every_n_steps
        self._actions = _wrapping.as_list(action, "PeriodicAction")
        self._targets = _wrapping.owners(*self._actions)
        self._controller: Any = None
        self._attach_step = 0
        self._last_step: int | None = None

    def __repr__(self) -> str:
        return f"PeriodicAction({self.action!r}, every_n_steps={self.every_n_steps})"

    @property
    def last_step(self) -> int | None:
        """The global step at the previous call (or restored from a checkpoint); None before."""
        return self._last_step

    def attach(self, controller: Any) -> None:
        """Read the global step from ``controller`` (noting its current value as the fallback
        reference). Forwarded to the actions' owners that have ``attach``."""
        self._controller = controller
        self._attach_step = int(controller.global_step)
        _wrapping.attach_all(self._targets, controller)

    def _reference(self) -> int:
        if self._last_step is not None:
            return self._last_step
        restored = getattr(self._controller, "restored_step", None)
        if isinstance(restored, int) and not isinstance(restored, bool):
            return restored
        return self._attach_step

    def __call__(self, output: dict[str, Any]) -> None:
        if self._controller is None:
            raise RuntimeError(
                "PeriodicAction was called before attach(controller): it reads the controller's "
                "global step. Pass it in the Controller's train_actions / eval_actions (which "
                "attaches it), or call attach() yourself"
            )
        step = int(self._controller.global_step)
        last = self._reference()
        self._last_step = step
        if step // self.every_n_steps > last // self.every_n_steps:
            _wrapping.run_all(self._actions, output)

    def state_dict(self) -> dict[str, Any]:
        """``{"last_step": int | None, "actions": {...inner states...}}``."""
        return {"last_step": self._last_step, "actions": _wrapping.state_of(self._targets)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        last = state.get("last_step")
        if last is not None:
            if not isinstance(last, int) or isinstance(last, bool):
                raise ValueError(f"PeriodicAction.load_state_dict: last_step must be an int or None, got {last!r}")
            self._last_step = last
        _wrapping.load_state_of(self._targets, state.get("actions") or {}, "PeriodicAction")
