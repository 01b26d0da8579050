"""Intervals in steps or in epochs: ``trainer.checkpoint_interval`` and ``trainer.validation_interval``
take an integer (optimizer steps) or ``"<n>ep"`` (epochs of the train input, Composer's notation),
converted to steps once the train input's length is known (:func:`interval_steps`)."""

from __future__ import annotations

import re
from typing import Any

from cadence.errors import ConfigError

__all__ = ["INTERVAL_FORM", "check_interval_value", "interval_epochs", "interval_steps"]

INTERVAL_FORM = "an integer >= 1 (steps) or '<n>ep' (epochs, e.g. '1ep')"
_EPOCHS = re.compile(r"^([1-9][0-9]*)\s*ep$")


def check_interval_value(value: Any) -> int | str | None:
    """A config value as an interval: ``None``, an int >= 1 (steps) or ``"<n>ep"`` (epochs,
    normalised: ``"2 ep"`` -> ``"2ep"``); ValueError (naming :data:`INTERVAL_FORM`) otherwise."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and (match := _EPOCHS.match(value.strip().lower())):
        return f"{match.group(1)}ep"
    raise ValueError(f"expected {INTERVAL_FORM} or null")  # the fields are nullable: the shape of every message


def interval_epochs(value: int | str | None) -> int | None:
    """The epochs of an interval given in epochs (``"2ep"`` -> 2); ``None`` for steps or none."""
    return int(value[:-2]) if isinstance(value, str) else None


def interval_steps(name: str, value: int | str | None, *, batches_per_epoch: int | None,
                   grad_accum_steps: int = 1) -> int | None:
    """``value`` (checked by :func:`check_interval_value`) in optimizer steps: an int as it is;
    ``"<n>ep"`` as ``n * batches_per_epoch / grad_accum_steps``. :class:`ConfigError` naming the
    field ``name`` when the train input has no length (``batches_per_epoch`` None) or when an
    epoch is not a whole number of optimizer steps (an accumulation group would span two epochs)."""
    epochs = interval_epochs(value)
    if epochs is None:
        return value if isinstance(value, int) else None
    if batches_per_epoch is None:
        raise ConfigError(f"{name} is {value!r} (in epochs), but the train data has no length (len()): an epoch "
                          "has no number of steps; give it in steps")
    if batches_per_epoch < 1:
        raise ConfigError(f"{name} is {value!r} (in epochs), but the train data has no batch (len() is 0)")
    if batches_per_epoch % grad_accum_steps:
        raise ConfigError(f"{name} is {value!r} (in epochs), but an epoch's {batches_per_epoch} batches are not a whole "
                          f"number of optimizer steps of trainer.grad_accum_steps ({grad_accum_steps}) batches: "
                          "give it in steps, or make grad_accum_steps divide the batches per epoch")
    return epochs * batches_per_epoch // grad_accum_steps
