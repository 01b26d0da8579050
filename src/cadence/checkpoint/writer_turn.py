"""Writers that take turns on one model dir: :class:`WriterTurn` (docs/design.md, "One writer per
model dir").

Fault-tolerant replica groups (``trainer.fault_tolerance``) train one run in one model dir. The chief
of one group holds the model dir's writer lease (:mod:`cadence.checkpoint.writer_lease`) and commits;
the other groups' chiefs stand by. A standby never refuses to start because a peer group holds
the lease, never writes in ``checkpoints/`` and tries to take the lease, without waiting, each time
it would commit (:meth:`WriterTurn.take`): it gets it once the holder is gone (same host: its pid
dead, at once; another host: once its lease expired) or released it, and commits from then on. A
holder that was only hung is fenced off by the token, as for any writer. A lease held by a plain
trainer (no replica group) refuses a replica group as it refuses a second trainer.
"""

from __future__ import annotations

import logging
from typing import Any

from cadence.checkpoint.writer_lease import WriterLease, check_free
from cadence.errors import WriterLeaseHeldError

__all__ = ["WriterTurn"]

logger = logging.getLogger("cadence.checkpoint")


class WriterTurn:
    """Replica group ``group``'s hold on ``model_dir``'s writer lease, or its wait for it.

    :attr:`lease` is the lease while this group holds it (it commits), None while it stands by.
    Only the group's chief makes one; :class:`~cadence.checkpoint.CheckpointManager` calls
    :meth:`take` before each change to the directory (``turn=``).
    """

    def __init__(self, model_dir: str, group: str, *, ttl: float,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.model_dir = model_dir
        self.group = group
        self.ttl = ttl
        self.storage_options = storage_options
        self.lease: WriterLease | None = None
        self._released = False

    @classmethod
    def start(cls, model_dir: str, group: str, *, ttl: float, first: bool,
              storage_options: dict[str, Any] | None = None) -> WriterTurn:
        """A group's turn at its start: ``first`` (group 0) tries to take the lease now; the others
        stand by until their first checkpoint.

        Raises:
          WriterLeaseHeldError: a live trainer that is no replica group holds the lease.
        """
        check_free(model_dir, storage_options=storage_options, group=group)
        turn = cls(model_dir, group, ttl=ttl, storage_options=storage_options)
        if first:
            turn.take()
        return turn

    @property
    def standby(self) -> bool:
        """True while another group holds the lease (this one commits nothing)."""
        return self.lease is None

    def take(self) -> WriterLease | None:
        """The lease: kept when held, else acquired now when it is free (non-blocking); None when a
        live peer holds it, or after :meth:`release`. A lease this group held and lost stays
        (its :meth:`~cadence.checkpoint.writer_lease.WriterLease.check` raises at the next commit)."""
        if self.lease is not None or self._released:
            return self.lease
        try:
            self.lease = WriterLease.acquire(self.model_dir, ttl=self.ttl, storage_options=self.storage_options,
                                             group=self.group)
        except WriterLeaseHeldError as e:
            logger.debug("replica %s stands by: %s", self.group, e)
            return None
        logger.info("replica %s holds the writer lease %d of %s: it commits the checkpoints", self.group,
                    self.lease.token, self.model_dir)
        return self.lease

    def release(self) -> None:
        """Release the lease when held (idempotent); no lease is taken afterwards."""
        self._released = True
        if self.lease is not None:
            self.lease.release()

    def __repr__(self) -> str:
        held = f"lease {self.lease.token}" if self.lease is not None else "standby"
        return f"WriterTurn({self.model_dir!r}, {self.group}, {held})"
