"""Which saved RNG state a rank restores on a device mesh (``TrainerCheckpoint.restore_rng``): the
ranks of a tensor-parallel group the same one, each data-parallel rank the state its data-parallel
rank saved, on the saving mesh and on another one; a rank with none saved is seeded by its
data-parallel rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cadence.torch import Context
from cadence.torch.loop.trainer_checkpoint import TrainerCheckpoint
from cadence.torch.runtime.rng import get_rng_state, rank_seed, seed_everything


def states(*seeds: int) -> list[dict]:
    """One saved RNG state per seed (a rank's), in rank order."""
    out = []
    for seed in seeds:
        seed_everything(seed)
        out.append(get_rng_state())
    return out


def restored(saved: list[dict], rank: int, world: int, tp: int, saved_tp: int) -> str:
    """The torch RNG state rank ``rank`` of a (dp = world / tp) x tp mesh holds after restoring ``saved``."""
    ctx = Context(rank=rank, world_size=world, dp_rank=rank // tp, dp_size=world // tp, seed=7)
    TrainerCheckpoint(SimpleNamespace(ctx=ctx), sharded=False).restore_rng(saved, "ckpt", 10, saved_tp)
    return get_rng_state()["torch"]


@pytest.mark.parametrize("saved_seeds, saved_tp, world, tp, expected", [
    ((0, 0, 1, 1), 2, 4, 2, [0, 0, 1, 1]),  # dp 2 x tp 2, resumed on the same mesh
    ((0, 1, 2, 3), 1, 4, 2, [0, 0, 1, 1]),  # dp 4 resumed on dp 2 x tp 2: a TP group shares its dp rank's state
    ((0, 0, 1, 1), 2, 4, 1, [0, 1, None, None]),  # dp 2 x tp 2 on dp 4: dp ranks 0-1 keep theirs, 2-3 are seeded
    ((0, 1), 1, 4, 2, [0, 0, 1, 1]),  # dp 2 on dp 2 x tp 2
    ((0,), 1, 4, 2, [0, 0, None, None]),  # one process on dp 2 x tp 2: dp rank 1 is seeded, both its ranks alike
])
def test_each_rank_restores_its_data_parallel_ranks_state(saved_seeds, saved_tp, world, tp, expected):
    saved = states(*saved_seeds)
    by_seed = {seed: state["torch"] for seed, state in zip(saved_seeds, saved)}
    got = [restored(saved, rank, world, tp, saved_tp) for rank in range(world)]
    for rank, seed in enumerate(expected):
        if seed is not None:
            assert got[rank] == by_seed[seed], rank
        else:  # seeded from (seed, dp_rank, step): equal within the TP group, new otherwise
            seed_everything(rank_seed(7, rank // tp, 10))
            assert got[rank] == get_rng_state()["torch"] and got[rank] not in by_seed.values(), rank
