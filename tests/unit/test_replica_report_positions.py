"""Every replica group's data position (:mod:`cadence.torch.fault_tolerance.positions`) on one
process: a restore picks its data shard's row of the checkpoint, not the writer's position; a heal
takes its row from the peer's table only when that is further on; the samples skipped and read
twice are counted at each step's outcome. (The exchange through torchft: tests/processes/test_replica_positions.py.)"""

from __future__ import annotations

import types

import pytest
import torch

from cadence.torch import ResumableLoader
from cadence.torch.fault_tolerance.positions import ReplicaPositions
from cadence.torch.loop.train_data import TrainData
from cadence.torch.loop.trainer_checkpoint import TrainerCheckpoint
from cadence.torch.runtime.context import Context
from cadence.torch.runtime.rng import rank_seed, seed_everything
from tasks import TinyTask, synthetic

BATCH = 4


def position(epoch: int, offset: int) -> dict:
    return {"kind": "stateful", "state": {"epoch": epoch, "offset": offset}}


def saved(writer: int = 0) -> dict:
    """A checkpoint's JSON state written by group ``writer`` of 2: each shard's own row."""
    return {"global_step": 6, "data": position(0, 48), "replica_groups": 2, "replica_writer": writer,
            "replica_data": [{"data": position(0, 48), "samples": 24, "committed": 24},
                             {"data": position(0, 32), "samples": 16, "committed": 24}]}


def group_ctx(group: int, groups: int = 2) -> Context:
    return Context(device="cpu", seed=3, replica_group=group, replica_groups=groups)


def train_data(ctx: Context) -> TrainData:
    index, count = ctx.data_shard()
    loader = ResumableLoader(synthetic(64, seed=1), BATCH, seed=ctx.seed, rank=index, world_size=count, drop_last=True)
    return TrainData(TinyTask(), ctx, loader)


@pytest.mark.parametrize("group", [0, 1])
def test_a_restore_picks_its_shards_row(group: int, caplog) -> None:
    checkpoint = TrainerCheckpoint(types.SimpleNamespace(ctx=group_ctx(group)), sharded=False)
    assert checkpoint.rank_data_state(saved(), "ckpt") == saved()["replica_data"][group]["data"]
    plain = TrainerCheckpoint(types.SimpleNamespace(ctx=Context(device="cpu")), sharded=False)
    assert plain.rank_data_state(saved(), "ckpt") == position(0, 48)  # no replica groups: the run's position
    three = TrainerCheckpoint(types.SimpleNamespace(ctx=group_ctx(2, groups=3)), sharded=False)
    assert three.rank_data_state(saved(), "ckpt") is None  # saved by 2 groups: no row for shard 2
    assert "no data position saved for data shard 2" in caplog.text


def test_restored_counters_and_the_rng_of_a_group_that_did_not_write() -> None:
    ctx = group_ctx(1)
    positions = ReplicaPositions(ctx, lambda batch: BATCH)
    seed_everything(123)
    before = torch.get_rng_state()
    positions.restored(saved(writer=1), data=True, rng=True, global_step=6)  # its own group wrote it
    assert torch.equal(torch.get_rng_state(), before)  # the RNG state as the checkpoint restored it
    assert (positions.drawn, positions.high) == (16, 24)
    assert positions.rows[0]["samples"] == 24  # the other group's row is kept for the next checkpoint
    positions.restored(saved(writer=0), data=True, rng=True, global_step=6)  # group 0's RNG state in it
    after = torch.get_rng_state()
    seed_everything(rank_seed(ctx.seed, 1, 6))  # re-seeded from (seed, its data shard, step) instead
    assert torch.equal(after, torch.get_rng_state()) and not torch.equal(after, before)


def test_counts_of_committed_dropped_and_repeated_steps() -> None:
    positions = ReplicaPositions(group_ctx(1), lambda batch: BATCH)
    positions.restored(saved(writer=0), data=True, rng=False, global_step=6)  # at 16 samples, had committed 24
    count = positions.counting(None)
    for committed in (True, False, True, True):  # re-reads 16-20; 20-24 drawn in a dropped step: skipped
        positions.start_step()
        count(object())
        positions.end_step(committed)
    assert (positions.drawn, positions.high) == (32, 32)
    assert positions.loop_logs() == {"replica_samples_skipped": 4.0, "replica_samples_repeated": 4.0}
    assert positions.loop_logs() == {"replica_samples_skipped": 0.0, "replica_samples_repeated": 0.0}


def test_a_heal_takes_the_peers_row_only_when_it_is_further_on() -> None:
    ctx = group_ctx(1)
    data = train_data(ctx)
    positions = ReplicaPositions(ctx, lambda batch: BATCH)
    positions.restored(saved(), data=True, rng=False, global_step=6)
    data.restore(saved()["replica_data"][1]["data"])
    table = {"0": {"data": position(0, 96), "samples": 48, "committed": 48},
             "1": {"data": position(0, 48), "samples": 24, "committed": 32}}
    positions.heal(table, data)
    assert data.state() == position(0, 48) and (positions.drawn, positions.high) == (24, 32)
    assert positions.rows[0]["samples"] == 48
    x, _ = next(data.iterator())  # the restored iterator draws from there on
    later = train_data(ctx)
    later.restore(position(0, 48))
    assert torch.equal(x, next(later.iterator())[0])
    positions.heal({"1": {"data": position(0, 16), "samples": 8, "committed": 8}}, data)  # behind: kept
    assert data.state() == position(0, 48 + 8) and positions.drawn == 24 and positions.high == 32


def test_a_position_taken_mid_loop_counts_the_loops_batches() -> None:
    """The loop adds its batches to the train data's count at its end; a replayed input's position
    exchanged at a step (or served to a healing peer) adds those drawn so far (``pending``)."""
    data = TrainData(TinyTask(), Context(device="cpu"), [torch.zeros(1)] * 5)
    it = data.iterator()
    next(it), next(it)
    assert data.state() == {"kind": "replay", "batches": 0}
    assert data.state(pending=2) == {"kind": "replay", "batches": 2}
