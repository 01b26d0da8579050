"""Run actions every N global steps: :class:`PeriodicAction`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from cadence.actions._wrapping import WrapperAction, run_all
from cadence.extensions import Action, RunContext

__all__ = ["PeriodicAction"]


class PeriodicAction(WrapperAction):
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

    The wrapped objects are attached and closed by the Controller, and their states carried in
    this action's, as for :class:`~cadence.actions.ConditionalAction`.

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
        super().__init__("PeriodicAction", action)
        self.action = action
        self.every_n_steps = every_n_steps
        self._run: RunContext | None = None
        self._attach_step = 0
        self._last_step: int | None = None

    def __repr__(self) -> str:
        return f"PeriodicAction({self.action!r}, every_n_steps={self.every_n_steps})"

    @property
    def last_step(self) -> int | None:
        """The global step at the previous call (or restored from a checkpoint); None before."""
        return self._last_step

    def attach(self, run: RunContext) -> None:
        """Read the global step from ``run`` (noting its current value as the fallback reference)."""
        self._run = run
        self._attach_step = int(run.global_step)

    def _reference(self) -> int:
        if self._last_step is not None:
            return self._last_step
        restored = self._run.restored_step if self._run is not None else None
        if restored is not None:
            return restored
        return self._attach_step

    def __call__(self, output: dict[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError(
                "PeriodicAction was called before attach(run): it reads the run's "
                "global step. Pass it in the Controller's train_actions / eval_actions (which "
                "attaches it), or call attach() yourself"
            )
        step = int(self._run.global_step)
        last = self._reference()
        self._last_step = step
        if step // self.every_n_steps > last // self.every_n_steps:
            run_all(self._actions, output)

    def state_dict(self) -> dict[str, Any]:
        """``{"last_step": int | None, "actions": {...inner states...}}``."""
        return {"last_step": self._last_step, "actions": super().state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        last = state.get("last_step")
        if last is not None:
            if not isinstance(last, int) or isinstance(last, bool):
                raise ValueError(f"PeriodicAction.load_state_dict: last_step must be an int or None, got {last!r}")
            self._last_step = last
        super().load_state_dict(state.get("actions") or {})
