"""Which committed checkpoints retention deletes (a pure function of the steps present)."""

from __future__ import annotations

from typing import Iterable

DEFAULT_MAX_TO_KEEP = 5
"""How many of the newest checkpoints retention keeps unless told (``trainer.max_to_keep``'s
default too)."""


def kept_every_n(steps: Iterable[int], n: int) -> set[int]:
    """Steps kept by ``keep_every_n_steps=n``.

    A checkpoint is kept when a multiple of ``n`` lies in ``(previous step, its step]``, the
    previous step being that of the checkpoint before it (0 for the first). With unaligned save
    intervals this keeps the first checkpoint at or after each multiple of ``n``. The choice is
    stable: deleting a checkpoint that is not kept never changes which others are.
    """
    kept: set[int] = set()
    previous = 0
    for step in sorted(steps):
        if step // n > previous // n:
            kept.add(step)
        previous = step
    return kept


def steps_to_delete(
    steps: Iterable[int],
    *,
    just_saved: int,
    max_to_keep: int | None,
    keep_every_n_steps: int | None,
    protected: Iterable[int] = (),
) -> list[int]:
    """Committed steps to delete, oldest first.

    Kept: the ``max_to_keep`` newest (all when None, none when 0), those kept by
    ``keep_every_n_steps`` (see :func:`kept_every_n`), the ``protected`` steps, and always
    ``just_saved``.
    """
    ordered = sorted(set(steps))
    if max_to_keep is None:
        return []
    keep = set(ordered[-max_to_keep:]) if max_to_keep > 0 else set()
    if keep_every_n_steps is not None:
        keep |= kept_every_n(ordered, keep_every_n_steps)
    keep |= set(protected)
    keep.add(just_saved)
    return [step for step in ordered if step not in keep]
