"""Every rank's write of its shards of a sharded checkpoint, now or on a background thread, and
the files all ranks wrote, gathered for the chief's manifest (see
:mod:`cadence.torch.checkpoint_io.sharded` for the files, :class:`~cadence.checkpoint.protocol.WritesShards`
for the protocol)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cadence.checkpoint.background import Pending, Worker, yield_cpu
from cadence.checkpoint.protocol import ShardTarget
from cadence.errors import CheckpointError
from cadence.torch.checkpoint_io.pipelined import stage_in_background
from cadence.torch.parallel import sharding

__all__ = ["ShardFiles", "ShardWrites"]

ShardFiles = list[dict[str, tuple[int, str]]]
"""The files each rank wrote, in rank order: ``{name: (size, hex checksum)}``."""

_WORKER = Worker("cadence-shards")  # writes this rank's shards of an asynchronous sharded save


class ShardWrites:
    """This rank's shard writes: one in flight at most; their collectives run on a gloo group of
    their own (created at the first write: a collective), so that a background write never
    interleaves with training's collectives on the default group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._pending: Pending | None = None  # the last write: every rank's files (or failure)
        self._stager: Any = None  # the CPU copy of the state, reused by each background write
        self._group: Any = None

    def write(self, state: Mapping[str, Any], target: ShardTarget, *, pipelined: bool = False) -> Pending | None:
        """Collective: write this rank's shards of ``state`` (live tensors) into
        ``target.directory``, checksum them and gather every rank's files. With
        ``target.background`` the state is copied to CPU memory (into the same memory each
        time) and written on a background thread: the copy is made now, or with ``pipelined`` on
        that thread too, and then the copy's outcome is returned: the tensors of ``state`` must
        not change before it is done (None otherwise). The previous write is waited for first; a
        failure of any rank is raised (:class:`CheckpointError`) on every rank, at once for a
        write now, by :meth:`wait` or the next write for a background one."""
        self.wait()
        if self._group is None:
            self._group = sharding.checkpoint_group()
        # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
        from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

        if target.background and pipelined:
            staging = stage_in_background(self._stage, state)  # at the training thread's priority: it waits for it
            self._pending = _WORKER.submit(self._write_staged, staging, target)  # writes once it is staged
            return staging
        if target.background:
            staged, self._stager = sharded_checkpoint.stage(state, self._stager)
            self._pending = _WORKER.submit(self._write_and_gather, staged, target, True)
        else:
            self._pending = Pending.done(self._write_and_gather(state, target, False))
            self.wait()
        return None

    def _stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
        from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

        staged, self._stager = sharded_checkpoint.stage(state, self._stager)
        return staged

    def _write_staged(self, staging: Pending, target: ShardTarget) -> list[tuple[dict[str, tuple[int, str]] | None, str | None]]:
        """Write what ``staging`` copied (a failed copy fails this rank's write, as a failed copy
        before a background write does)."""
        staged = staging.result()
        return self._write_and_gather(staged, target, True)

    def wait(self) -> None:
        """Wait for the write in flight; raise a failure of any rank (once)."""
        if self._pending is not None:
            try:
                files_of(self._pending, self.rank)
            except CheckpointError:
                self._pending = None
                raise

    def take(self) -> Pending:
        """The last write's outcome (for the chief's manifest: :func:`files_of`), handed over
        once. ``RuntimeError`` when there was none."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("a sharded model's checkpoint needs write_shards() on all ranks first")
        return pending

    def _write_and_gather(self, state: Mapping[str, Any], target: ShardTarget,
                          background: bool) -> list[tuple[dict[str, tuple[int, str]] | None, str | None]]:
        """Write, then gather ``(files, error)`` of every rank, the same list on every rank (the
        gather completes whatever failed: no rank is left waiting in a collective). ``error``:
        this rank's failure, ``""`` when it only heard of another rank's."""
        if background:
            yield_cpu()
        # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
        from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

        files: dict[str, tuple[int, str]] | None = None
        error = None
        try:
            files = sharded_checkpoint.write_shards(state, target.directory, process_group=self._group,
                                                    algorithm=target.algorithm, storage_options=target.storage_options)
        except sharded_checkpoint.SaveError as e:  # every rank hears of it through the gather
            error = sharded_checkpoint.own_failure(e, self.rank)
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, (files, error), group=self._group)
        return gathered


def files_of(pending: Pending, rank: int) -> ShardFiles:
    """The files every rank wrote (``pending``: a write's gathered outcome, seen from ``rank``).
    Raises :class:`CheckpointError` naming the ranks that failed."""
    try:
        gathered = pending.result()
    except Exception as e:
        raise CheckpointError(f"rank {rank} could not write its checkpoint shards: {e}") from e
    failed = [f"rank {r}: {error}" for r, (_, error) in enumerate(gathered) if error]
    if failed or any(error is not None for _, error in gathered):
        raise CheckpointError("could not write the checkpoint shards: " + ("; ".join(failed) or "a rank failed"))
    return [files or {} for files, _ in gathered]
