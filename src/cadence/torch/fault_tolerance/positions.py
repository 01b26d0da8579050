"""Every replica group's data position, known to every group (:class:`ReplicaPositions`), and the
samples the groups skip or read twice.

Each data shard (``ctx.data_shard()[0]`` = ``group * dp_size + dp_rank``) has a row: ``data``, its
train-data position (:meth:`TrainData.state`, JSON), ``samples``, the samples drawn from the shard's
stream up to that position (committed steps and dropped ones), and ``committed``, the furthest
``samples`` a committed step reached. A rank keeps the rows of its column: the shards of its
``dp_rank`` in every group, the ranks it all-reduces gradients with.

Exchanged through the torchft manager's process group (:class:`~cadence.torch.fault_tolerance.ReplicaSync`):

- every step, a header of 8 numbers per group rides on the gradient all-reduce (one collective): the
  group took part, it asks for an exchange, and ``committed`` after this step (in base-256 digits:
  exact in any float dtype, as each group fills only its own row of the sum);
- when a group asks (the last step of its loop), every group of the step sends its row: the rows'
  lengths, then their bytes (two more collectives, sized by what all of them read in the header).

The rows take effect only when the step commits; a group lost in the middle makes the manager
report an error, the step is dropped and nothing is taken. A group that took no part in a step
keeps its last row (its ``committed`` stays what its last committed step reached).

Counts (per loop, :meth:`loop_logs`): ``replica_samples_skipped``, the samples drawn in steps that
were not committed (dropped and run again on the next batches); ``replica_samples_repeated``, the
samples of committed steps that this shard had already reached in a committed step (it was put
behind that by a restore or a heal). A lost group's batches of the step it died in are in neither:
its restart continues from a committed position, before them.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

import torch
from torch.distributed import ReduceOp

from cadence.torch.loop.train_data import TrainData
from cadence.torch.loop.trainer_checkpoint import shard_row
from cadence.torch.runtime.context import Context
from cadence.torch.runtime.rng import rank_seed, seed_everything

__all__ = ["ReplicaPositions"]

log = logging.getLogger(__name__)

HEADER = 8
"""Numbers per group in the step's header: took part, asks for an exchange, then ``committed`` in 6
base-256 digits (up to 2**48 samples)."""


def _digits(value: int) -> list[int]:
    return [(value >> (8 * i)) & 255 for i in range(HEADER - 2)]


def _number(digits: list[int]) -> int:
    return sum(d << (8 * i) for i, d in enumerate(digits))


def _row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row as this table keeps it, from a checkpoint or a peer's table: ``data``, ``samples``, ``committed``."""
    return {"data": row.get("data"), "samples": int(row.get("samples", 0)), "committed": int(row.get("committed", 0))}


class ReplicaPositions:
    """One rank's table of its column's data positions, its own counters, and the exchange."""

    def __init__(self, ctx: Context, size_of: Callable[[Any], int]) -> None:
        self.ctx = ctx
        self.groups, self.group = ctx.replica_groups, ctx.replica_group
        self.shard = ctx.data_shard()[0]
        self._size_of = size_of
        self.rows: dict[int, dict[str, Any]] = {}  # shard -> {"data", "samples", "committed"}
        self.drawn = 0  # this shard's ``samples``: where its stream is
        self.high = 0  # its ``committed``
        self._step = 0  # samples drawn in the step in flight
        self._pending: tuple[dict[int, int], dict[int, dict[str, Any]]] | None = None
        self.skipped = self.repeated = 0  # this loop's

    def _shard_of(self, group: int) -> int:
        return group * self.ctx.dp_size + self.ctx.dp_rank

    # -- the loop --------------------------------------------------------------------------------

    def counting(self, count: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """The loop's per-batch counter: adds the batch's samples to the step in flight, then ``count``."""
        size_of = self._size_of

        def counted(batch: Any) -> None:
            self._step += size_of(batch)
            if count is not None:
                count(batch)

        return counted

    def start_step(self) -> None:
        """A step starts: nothing drawn in it yet."""
        self._step, self._pending = 0, None

    def header(self, dtype: torch.dtype, exchange: bool) -> torch.Tensor:
        """This group's row of the step's header (zeros in the others' rows)."""
        header = torch.zeros(self.groups * HEADER, dtype=dtype)
        committed = max(self.high, self.drawn + self._step)
        header[self.group * HEADER:(self.group + 1) * HEADER] = torch.tensor(
            [1, int(exchange), *_digits(committed)], dtype=dtype)
        return header

    def exchange(self, summed: torch.Tensor, manager: Any, position: Callable[[], Any]) -> None:
        """After the all-reduce of the headers (``summed``): stage every group's ``committed``; when
        any group asked, send this group's row (``position()``: its data position now) and stage
        every row received (two all-reduces through ``manager``). Staged rows are taken by
        :meth:`end_step` if the step commits."""
        numbers = summed.round().to(torch.int64).view(self.groups, HEADER).tolist()
        took_part = [g for g, row in enumerate(numbers) if row[0] == 1]
        highs = {g: _number(numbers[g][2:]) for g in took_part}
        rows: dict[int, dict[str, Any]] = {}
        if any(numbers[g][1] for g in took_part) and manager.errored() is None:
            own = json.dumps({"data": position(), "samples": self.drawn + self._step}).encode()
            lengths = torch.zeros(self.groups, dtype=torch.float32)
            lengths[self.group] = len(own)
            manager.allreduce(lengths, reduce_op=ReduceOp.SUM).wait()
            sizes = [int(n) for n in lengths.round().tolist()]
            table = torch.zeros(self.groups, max(sizes), dtype=torch.float32)
            table[self.group, :len(own)] = torch.frombuffer(bytearray(own), dtype=torch.uint8).float()
            manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
            if manager.errored() is None:
                received = table.round().to(torch.uint8)
                for g in took_part:
                    if sizes[g]:
                        rows[g] = json.loads(bytes(received[g, :sizes[g]].tolist()))
        self._pending = (highs, rows)

    def end_step(self, committed: bool) -> None:
        """The vote's outcome: a committed step moves this shard on and takes the staged rows; a
        dropped one's samples were skipped (the stream has moved past them all the same)."""
        start, n = self.drawn, self._step
        self.drawn, self._step = start + n, 0
        pending, self._pending = self._pending, None
        if not committed:
            self.skipped += n
            return
        self.repeated += max(0, min(start + n, self.high) - start)
        self.high = max(self.high, self.drawn)
        highs, rows = pending if pending is not None else ({}, {})
        for group, row in rows.items():
            self.rows[self._shard_of(group)] = {"data": row["data"], "samples": int(row["samples"])}
        for group, high in highs.items():
            row = self.rows.setdefault(self._shard_of(group), {"data": None, "samples": 0})
            row["committed"] = max(int(row.get("committed", 0)), high)

    def loop_logs(self) -> dict[str, float]:
        """``replica_samples_skipped`` and ``replica_samples_repeated`` since the last call."""
        logs = {"replica_samples_skipped": float(self.skipped), "replica_samples_repeated": float(self.repeated)}
        self.skipped = self.repeated = 0
        return logs

    # -- checkpoints and healing -----------------------------------------------------------------

    def table(self, data_state: Any) -> dict[int, dict[str, Any]]:
        """Every row this rank knows, its own as of now (``data_state``: its position); a copy."""
        rows = {shard: dict(row) for shard, row in self.rows.items()}
        rows[self.shard] = {"data": data_state, "samples": self.drawn, "committed": self.high}
        return json.loads(json.dumps(rows))  # a copy; JSON turns the shards into strings

    def restored(self, state: Mapping[str, Any], data: bool, rng: bool, global_step: int) -> None:
        """After a checkpoint's restore (the JSON ``state``): the rows of this rank's column, its
        own counters from its shard's row (``data``: its position was restored), and, when another
        group wrote the checkpoint (``replica_writer``), this rank's RNG seeded from
        ``(seed, its data shard, global_step)`` (``rng``) instead of the writer's state."""
        for group in range(self.groups):
            row = shard_row(state, self._shard_of(group))
            if row is not None:
                self.rows[self._shard_of(group)] = _row(row)
        own = self.rows.get(self.shard)
        if data:
            self.drawn = own["samples"] if own is not None else 0
            self.high = own["committed"] if own is not None else 0
        writer = state.get("replica_writer")
        if rng and isinstance(writer, int) and writer != self.group:
            seed_everything(rank_seed(self.ctx.seed, self.shard, global_step))

    def heal(self, rows: Mapping[Any, Any] | None, data: TrainData) -> None:
        """A peer's :meth:`table` taken in a heal: this shard continues from its row there when that
        is further on than its own position (the train data restored to it), and keeps the furthest
        of each other row."""
        for key, row in (rows or {}).items():
            shard, theirs = int(key), _row(row)
            if shard == self.shard:
                self.high = max(self.high, theirs["committed"])
                if theirs["samples"] > self.drawn and theirs["data"] is not None:
                    log.info("replica group %d: its data position from the peer's table (%d samples drawn, "
                             "%d here)", self.group, theirs["samples"], self.drawn)
                    data.restore(theirs["data"])
                    self.drawn = theirs["samples"]
                continue
            mine = self.rows.get(shard)
            if mine is None or theirs["samples"] > mine["samples"]:
                self.rows[shard] = theirs
            elif theirs["committed"] > int(mine.get("committed", 0)):
                mine["committed"] = theirs["committed"]
