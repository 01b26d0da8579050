"""The sanity check before training (Lightning's ``num_sanity_val_steps``): :func:`sanity_check`.

An error in the validation code or in an eval action's settings (a misnamed metric) would
otherwise surface only at the first evaluation, after training steps have run. A few validation
batches are run through the real evaluator before the first training step, and the eval actions
that read the metrics check that they are there (:class:`~cadence.extensions.ChecksOutputs`).
Nothing is written: no summary, no metrics file, no action state, and no external evaluator runs
(``evaluators:``: their metrics are NaN); the evaluator leaves the
training's RNG, data position and the model's modes as they were (its validation data is
iterated afresh for each evaluation).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable

from cadence.errors import CadenceError, SanityCheckError, ValidationOutputError
from cadence.extensions import ChecksOutputs
from cadence.loop.members import components
from cadence.extensions import Evaluator
from cadence.sidecar.external import RunsExternal

logger = logging.getLogger("cadence")

__all__ = ["sanity_check"]


def sanity_check(evaluator: Evaluator, eval_actions: Iterable[object], steps: int) -> dict[str, Any]:
    """Evaluate ``steps`` (>= 1) validation batches, then let each eval action (wrapped ones
    too) that is :class:`~cadence.extensions.ChecksOutputs` check the metrics; return them.

    Collective in a multi-process run (the evaluation is): every rank calls it.

    Raises:
      SanityCheckError: (exit 2) the evaluation returned outputs of the wrong type
        (:class:`~cadence.errors.ValidationOutputError`), or an action's check failed; one line.
        Other errors of the validation code propagate as they are, with their traceback.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"sanity_check: steps must be an int >= 1, got {steps!r}")
    what = f"sanity check ({steps} validation batch{'es' if steps > 1 else ''} before training)"
    logger.info("%s", what)
    quiet = evaluator.without_external() if isinstance(evaluator, RunsExternal) else contextlib.nullcontext()
    try:
        with quiet:  # no external evaluator command: their metrics are NaN
            metrics = dict(evaluator.evaluate(steps) or {})
    except ValidationOutputError as e:
        raise SanityCheckError(f"{what}: {e}") from e
    for obj in components(eval_actions):
        if isinstance(obj, ChecksOutputs):
            try:
                obj.check_outputs(metrics)
            except CadenceError as e:
                raise SanityCheckError(f"{what}: {e}") from e
    return metrics
