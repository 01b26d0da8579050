"""Which committed checkpoints retention deletes: a pure function of the steps present
(:func:`steps_to_delete`) and of what is protected besides (:func:`protected_steps`); one
retention pass (:func:`apply`)."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from cadence.checkpoint.leases import Leases
from cadence.checkpoint.listing import committed_steps
from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

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


def protected_steps(steps: Iterable[int], leases: Leases,
                    extra: Callable[[], Iterable[int]] | None = None) -> set[int] | None:
    """The steps among ``steps`` retention must keep besides the newest: those protected by an
    unexpired reader's lease (:meth:`~cadence.checkpoint.leases.Leases.protected_steps`), and those
    ``extra()`` returns. None (a warning logged) when either cannot be read: delete nothing then."""
    try:
        protected = leases.protected_steps(steps)
    except Exception:  # noqa: BLE001 - unknown leases: delete nothing this time
        logger.warning("could not read the readers' leases in %s; skipping retention this time",
                       leases.storage.url(leases.root), exc_info=True)
        return None
    try:
        if extra is not None:
            protected |= set(extra())
    except Exception:  # noqa: BLE001 - unknown leases: delete nothing this time
        logger.warning("protected_steps failed; skipping retention this time", exc_info=True)
        return None
    return protected


def apply(storage: Storage, leases: Leases, just_saved: int, *, max_to_keep: int, keep_every_n_steps: int | None,
          extra: Callable[[], Iterable[int]] | None, check: Callable[[str], None], delete: Callable[[int], None],
          path: Callable[[int], str]) -> None:
    """One retention pass after ``just_saved`` was committed: note the doomed steps for readers
    (:meth:`~cadence.checkpoint.leases.Leases.record_deleted`), then ``delete`` each. ``check(what)``
    (the writer's fence) runs before anything is deleted and may raise. Nothing is deleted when the
    leases or ``extra()`` cannot be read, or the note cannot be written; a failed deletion is
    logged and the others go on.

    A checkpoint protected by an unexpired reader's lease (its ``reading`` step, or any step after
    its ``after``; :mod:`cadence.checkpoint.leases`) is kept until the lease ends or is released.
    Each pass reads the leases once (one listing of ``.leases/`` and one small read per lease)."""
    steps = committed_steps(storage)
    protected = protected_steps(steps, leases, extra)
    if protected is None:  # unknown: delete nothing this time
        return
    doomed = steps_to_delete(steps, just_saved=just_saved, max_to_keep=max_to_keep,
                             keep_every_n_steps=keep_every_n_steps, protected=protected)
    if not doomed:
        return
    check("delete old checkpoints (retention)")
    try:  # readers record the ones they never saw as skipped
        leases.record_deleted(doomed)
    except Exception:  # noqa: BLE001 - unnoted, they could vanish unseen: delete nothing this time
        logger.warning("could not note the checkpoints retention deletes in %s; skipping retention this time",
                       leases, exc_info=True)
        return
    for step in doomed:
        try:
            delete(step)
        except Exception:  # noqa: BLE001 - the save itself succeeded
            logger.warning("could not delete checkpoint %s", path(step), exc_info=True)
