"""``trainer.parallel`` in one process: the degrees' form at load, their resolution against the world
size and the Task (one line each), the data split over the data-parallel ranks, and throughput counting
each sample once under tensor parallelism."""

from __future__ import annotations

import itertools
import re

import pytest
from pydantic import ValidationError

from cadence.config.components.parallel import ParallelConfig
from cadence.config.trainer import TrainerConfig
from cadence.errors import ConfigError
from cadence.summaries.throughput import LoopWork, throughput_logs
from cadence.torch import Context
from cadence.torch.experiments.runners import attach_mesh
from cadence.torch.parallel.mesh import MeshDegrees, resolve_degrees, strategy_degrees
from tasks import TinyTask
from tp_tasks import TPTask


@pytest.mark.parametrize("degrees, message", [
    ({"tp": 0}, "tp\n  Value error, expected -1 (the rest of the world) or an integer >= 1"),
    ({"dp_shard": -2}, "dp_shard\n  Value error, expected -1"),
    ({"dp_replicate": -1, "dp_shard": -1}, "only one degree may be -1, got dp_replicate and dp_shard"),
])
def test_bad_degrees_are_refused_at_load(degrees, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ParallelConfig(**degrees)


def test_fp16_is_refused_with_sharding_or_tp_and_strategy_stays_as_it_was():
    with pytest.raises(ValidationError, match="not supported with trainer.parallel's sharding"):
        TrainerConfig(precision="fp16", parallel={"tp": 2})
    assert TrainerConfig(precision="fp16", parallel={"dp_replicate": -1}).parallel == ParallelConfig(dp_replicate=-1)
    assert TrainerConfig().parallel is None  # existing configs: strategy's 1-D mesh
    assert strategy_degrees("ddp", 4) == MeshDegrees(dp_replicate=4)
    assert strategy_degrees("fsdp", 4) == MeshDegrees(dp_shard=4)


def test_degrees_resolve_against_the_world_and_the_task_in_one_line():
    assert resolve_degrees(-1, 2, 2, 8) == MeshDegrees(2, 2, 2)
    assert resolve_degrees(1, -1, 2, 4, tp_divisor=16) == MeshDegrees(1, 2, 2)
    degrees = MeshDegrees(dp_replicate=2, dp_shard=1, tp=2)
    assert [degrees.dp_rank(r) for r in range(4)] == [0, 0, 1, 1] and degrees.dp_size == 2
    with pytest.raises(ConfigError, match=r"^trainer.parallel \(dp_replicate=1, dp_shard=2, tp=2\): the degrees' "
                                          r"product 4 is not the world size 2 \(processes\)$"):
        resolve_degrees(1, 2, 2, 2)
    with pytest.raises(ConfigError, match="the world size 6 .* does not divide by 4"):
        resolve_degrees(-1, 2, 2, 6)
    with pytest.raises(ConfigError, match=r"^trainer.parallel.tp: 3 does not divide 16, what TPTask splits"):
        resolve_degrees(1, 1, 3, 3, tp_divisor=16, task_name="TPTask")


def test_attach_mesh_refuses_tp_for_a_task_without_a_plan_before_building_anything():
    ctx = Context(rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"^trainer.parallel.tp is 2, but TinyTask has no tensor-parallel plan "
                                          r"\(override Task.parallelize\)$"):
        attach_mesh(TinyTask(), ctx, ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match="tp: 2 does not divide 5"):
        attach_mesh(TPTask(tp_divisor=5), ctx, ParallelConfig(tp=2))
    assert ctx.mesh is None and (ctx.dp_rank, ctx.dp_size) == (0, 2)
    with pytest.raises(NotImplementedError, match="TinyTask has no tensor-parallel plan"):
        TinyTask().parallelize(TinyTask().build_model(), None)


def test_the_data_is_split_over_the_data_parallel_ranks_only():
    # 4 ranks, tp 2: ranks 2 and 3 are data-parallel rank 1 of 2
    ranks = [Context(rank=r, world_size=4, dp_rank=r // 2, dp_size=2) for r in range(4)]
    assert {ctx.per_rank_batch(8) for ctx in ranks} == {4}
    with pytest.raises(ConfigError, match="does not divide by the data-parallel size 2: use a multiple of 2, e.g. 8 or 10$"):
        ranks[0].per_rank_batch(9)
    data = list(range(10))
    parts = [list(ctx.wrap_dataset(data)) for ctx in ranks]
    assert parts[0] == parts[1] == [0, 2, 4, 6, 8] and parts[2] == parts[3] == [1, 3, 5, 7, 9]
    loaders = [ctx.loader(data, 2, shuffle=False) for ctx in ranks]
    batches = [[b.tolist() for b in itertools.islice(loader, 2)] for loader in loaders]  # one epoch
    assert batches[0] == batches[1] != batches[2] == batches[3]
    assert (Context(rank=3, world_size=4).dp_rank, Context(rank=3, world_size=4).dp_size) == (3, 4)  # no mesh: every rank
    with pytest.raises(ValueError, match="does not fit world_size 4"):
        Context(rank=0, world_size=4, dp_rank=0, dp_size=3)


def test_throughput_counts_each_sample_once_under_tensor_parallelism():
    plain = throughput_logs(LoopWork(samples=10, tokens=100, world_size=4, flops_per_sample=1e12, peak_flops=1e13), 1.0)
    tp = throughput_logs(LoopWork(samples=10, tokens=100, world_size=4, flops_per_sample=1e12, peak_flops=1e13,
                                  shared_by=2), 1.0)
    assert plain["samples_per_second"] == 40 and tp["samples_per_second"] == 20
    assert tp["tokens_per_second"] == 200
    assert tp["mfu"] == pytest.approx(plain["mfu"] / 2)
