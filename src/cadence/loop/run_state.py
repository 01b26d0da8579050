"""What a checkpoint of a controller's run holds, and what restoring one does: :class:`RunState`."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from cadence.checkpoint.protocol import Restorable
from cadence.checkpoint.session import CheckpointSession
from cadence.extensions import Evaluator, Initializable, Trainer
from cadence.loop.members import stateful_members
from cadence.loop.schedule import EvalState

logger = logging.getLogger("cadence")

__all__ = ["RunState"]


class RunState:
    """The objects of one run that its checkpoints hold, saved and restored through ``session``.

    A checkpoint holds the loop's own state (``controller``: :class:`~cadence.loop.schedule.EvalState`),
    the trainer -- or a lone evaluator -- when it is ``Restorable``, and, with a trainer, the
    ``Stateful`` actions and callbacks (``train_actions/<i>/<Class>``, ``eval_actions/...``,
    ``callbacks/...``). An evaluator-only run leaves the actions' state alone: the checkpoint's
    action states belong to the training run."""

    def __init__(self, session: CheckpointSession, trainer: Trainer | None, evaluator: Evaluator | None, *,
                 train_actions: Sequence[object], eval_actions: Sequence[object], callbacks: Sequence[object]) -> None:
        self.session = session
        self.loop = EvalState()
        self._runner = trainer if trainer is not None else evaluator
        self._runner_name = "trainer" if trainer is not None else "evaluator"
        self._members = (lambda: stateful_members(train_actions=train_actions, eval_actions=eval_actions,
                                                  callbacks=callbacks)) if trainer is not None else dict
        self._eval_members = lambda: stateful_members(eval_actions=eval_actions, callbacks=callbacks)

    def objects(self) -> dict[str, object]:
        """What a checkpoint of the run holds now, by name."""
        objects: dict[str, object] = {"controller": self.loop}
        if isinstance(self._runner, Restorable):
            objects[self._runner_name] = self._runner
        objects.update(self._members())
        return objects

    def restore(self, step: int | None) -> int | None:
        """Restore checkpoint ``step`` (``None``: the latest) into the objects; the restored step.
        With nothing to restore the runner's ``initialize()`` runs (if it is Initializable) and
        None is returned."""
        restored = self.session.restore(self.objects(), step)
        if restored is None and isinstance(self._runner, Initializable):
            self._runner.initialize()
        return restored

    def before_evaluation(self) -> Callable[[], dict[str, object]]:
        """What a checkpoint saved on an evaluation's error holds: the loop's, the eval actions' and
        the callbacks' state as before the evaluation (frozen now), so a resumed run runs it again."""
        if not self.session.commits_on_error:
            return self.objects
        before = self.session.frozen({"controller": self.loop, **self._eval_members()})
        return lambda: {**self.objects(), **before}
