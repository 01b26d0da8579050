"""Multi-process PyTorch: the process group, the context's distributed helpers, DDP training,
per-rank RNG in checkpoints, the data position across world sizes, and the dataset cache.

The multi-process tests run real ranks (gloo on CPU) through ``python -m torch.distributed.run``
and ``tests/dist_worker.py``; each job takes a few seconds and is shared by the tests that read
its reports.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from cadence.checkpoint.files import MemoryWriter
from cadence.errors import ConfigError
from cadence.runtime.coordination import LocalCoordinator
from cadence.torch import Context, ResumableLoader, ResumableSampler, TorchTrainer
from cadence.torch.runtime.rng import seed_everything
from cadence.torch.runtime.distributed import init_distributed, rank_env, shutdown_distributed
from cadence.torch.runtime.rng import rank_seed
from cli_run import run_python, torchrun_command
from dist_worker import IdsTask

WORKER = str(Path(__file__).parents[1] / "dist_worker.py")


def run_ranks(nproc: int, scenario: str, out: Path, *args: str) -> list[dict]:
    """Run ``dist_worker.py SCENARIO`` on ``nproc`` ranks (one plain process for 1); every rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        cmd = [sys.executable, WORKER, scenario, str(out), *args]
    else:
        cmd = torchrun_command(nproc, WORKER, scenario, str(out), *args)
    proc = run_python(cmd[1:], timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(nproc)]


# -- single process ---------------------------------------------------------------------------------


def test_rank_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert rank_env() == (0, 1, 0)
    assert rank_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == (2, 4, 0)
    with pytest.raises(ValueError, match="RANK=4"):
        rank_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        rank_env({"WORLD_SIZE": "two"})


def test_init_distributed_without_torchrun_is_a_single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed() is None
    assert not torch.distributed.is_initialized()
    shutdown_distributed()  # nothing to destroy: a no-op


def test_init_distributed_names_the_missing_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT are not set"):
        init_distributed()
    assert not torch.distributed.is_initialized()


def test_single_process_context(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = Context.create("cpu", seed=3)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_chief) == (0, 1, 0, True)
    assert isinstance(ctx.coordinator, LocalCoordinator) and not ctx.is_distributed
    assert Context().coordinator is not None and Context() == Context()
    model = nn.Linear(2, 2)
    assert ctx.wrap_model(model) is model
    ds = TensorDataset(torch.arange(10))
    assert ctx.wrap_dataset(ds) is ds and ctx.wrap_dataset(ds, shard=False) is ds
    train = ctx.loader(ds, 4, epochs=1)
    assert isinstance(train, ResumableLoader) and not train.drop_last and train.seed == 3
    assert len(list(train)) == 3
    evaluation = ctx.loader(ds, 4, train=False)
    assert isinstance(evaluation, DataLoader) and [b.tolist() for (b,) in evaluation][0] == [0, 1, 2, 3]
    assert ctx.gather("x") == ["x"] and ctx.allgather(1) == [1] and ctx.broadcast(5) == 5
    ctx.barrier()


def test_wrap_dataset_shards_without_padding():
    ds = TensorDataset(torch.arange(1001))
    for w in (2, 3):
        shards = [Context(rank=r, world_size=w).wrap_dataset(ds) for r in range(w)]
        seen = [int(s[i][0]) for s in shards for i in range(len(s))]
        assert sorted(seen) == list(range(1001))  # disjoint, complete, no padding
        assert [len(s) for s in shards] == [len(range(r, 1001, w)) for r in range(w)]
    with pytest.raises(TypeError, match="map-style"):
        Context(rank=0, world_size=2).wrap_dataset(_Stream())


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_collectives_without_a_process_group_are_a_clear_error():
    ctx = Context(rank=1, world_size=2)
    assert ctx.coordinator is None
    with pytest.raises(RuntimeError, match="no coordinator"):
        ctx.allgather(1)
    with pytest.raises(RuntimeError, match="not initialised"):
        ctx.wrap_model(nn.Linear(2, 2))


# -- dataset cache, one process ----------------------------------------------------------------------


def test_cache_dataset_builds_once_and_round_trips(tmp_path):
    builds = []

    def make(ctx: Context):
        @ctx.cache_dataset("toy", "v1", cache_dir=tmp_path)
        def build():
            builds.append(1)
            return {"x": torch.arange(6.0).reshape(2, 3), "y": np.arange(4, dtype=np.uint8), "s": np.float32(1.5),
                    "t": (1, "a", None, b"z"), "l": [np.zeros((2, 2)).T]}

        return build

    first = make(Context())()
    second = make(Context())()  # a later run: loads
    assert builds == [1]
    for value in (first, second):
        assert torch.equal(value["x"], torch.arange(6.0).reshape(2, 3))
        assert value["y"].dtype == np.uint8 and value["y"].tolist() == [0, 1, 2, 3]
        assert isinstance(value["s"], np.float32) and value["s"] == 1.5
        assert value["t"] == (1, "a", None, b"z") and value["l"][0].shape == (2, 2)
    assert [p.name for p in (tmp_path / "toy" / "v1").iterdir()] == ["data.pt"]  # no temp file left


def test_cache_dataset_default_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    assert Context().cache_dataset("d", "1")(lambda: [1, 2])() == [1, 2]
    assert (tmp_path / "d" / "1" / "data.pt").is_file()


def test_cache_dataset_refuses_what_weights_only_cannot_load(tmp_path):
    ctx = Context()
    with pytest.raises(TypeError, match=r"value\['ds'\] is a torch.utils.data.dataset.TensorDataset"):
        ctx.cache_dataset("bad", "v1", cache_dir=tmp_path)(lambda: {"ds": TensorDataset(torch.arange(3))})()
    with pytest.raises(TypeError, match=r"value\[0\] is a builtins.set"):
        ctx.cache_dataset("bad", "v2", cache_dir=tmp_path)(lambda: [{1, 2}])()
    with pytest.raises(TypeError, match="dtype <U1"):
        ctx.cache_dataset("bad", "v3", cache_dir=tmp_path)(lambda: np.array(["a"]))()
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").rglob("*.pt"))
    for bad_name in ("", "a/b", "..", "x y"):
        with pytest.raises(ValueError, match="one path component"):
            ctx.cache_dataset(bad_name, "v1", cache_dir=tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_cache_dataset_never_unpickles_a_planted_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "cache" / "evil" / "v1" / "data.pt"
    target.parent.mkdir(parents=True)
    torch.save({"x": _Evil()}, target)
    with pytest.raises(RuntimeError, match="weights_only=True"):
        Context().cache_dataset("evil", "v1", cache_dir=tmp_path / "cache")(lambda: [1])()
    assert not (tmp_path / "PWNED").exists()


# -- RNG in checkpoints, one process -----------------------------------------------------------------


class _Writer(MemoryWriter):
    """Writes files in memory and reads them back (both halves of the checkpoint protocol)."""

    def __init__(self) -> None:
        super().__init__(step=0)
        self.path = "mem"

    def read(self, name):
        return self.files[name]

    def view(self, name):
        return memoryview(self.files[name])

    def names(self):
        return sorted(self.files)


def _trainer(ctx: Context) -> TorchTrainer:
    task = IdsTask()
    model = task.build_model()
    return TorchTrainer(task, model, task.build_optimizer(model), ctx=ctx)


def test_rng_is_a_list_of_rank_states_and_old_checkpoints_still_load():
    seed_everything(1)
    trainer = _trainer(Context())
    files = _Writer()
    state = json.loads(json.dumps(trainer.save_checkpoint(files)))
    assert isinstance(state["rng"], list) and len(state["rng"]) == 1
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"}
    expected = [torch.rand(2).tolist(), random.random(), float(np.random.rand())]
    trainer.load_checkpoint(files, state)
    assert [torch.rand(2).tolist(), random.random(), float(np.random.rand())] == expected
    legacy = {**state, "rng": state["rng"][0]}  # a checkpoint from before per-rank states
    trainer.load_checkpoint(files, legacy)
    assert torch.rand(2).tolist() == expected[0]


def test_elastic_rng_states_in_process(caplog):
    seed_everything(1)
    source = _trainer(Context())
    files = _Writer()
    source.prepare_checkpoint()
    state = source.save_checkpoint(files)
    state["rng"] = state["rng"] * 2  # as if saved by 2 ranks
    state["global_step"] = 7
    new_rank = _trainer(Context(rank=2, world_size=3, seed=4))
    with caplog.at_level(logging.WARNING, logger="cadence.torch.loop.trainer_checkpoint"):
        new_rank.load_checkpoint(files, state)
    assert "none for rank 2 of 3" in caplog.text
    got = torch.rand(3)
    seed_everything(rank_seed(4, 2, 7))
    assert torch.equal(got, torch.rand(3))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cadence.torch.loop.trainer_checkpoint"):
        _trainer(Context()).load_checkpoint(files, state)
    assert "that of rank 1 is not used" in caplog.text


# -- the data position across world sizes (simulated ranks) -------------------------------------------


def _global_sequence(per_rank: list[list[list[int]]], batch_size: int) -> list[int]:
    """Samples in global-position order from each rank's batches (rank r's j-th sample of batch t
    is at position t*W*B + j*W + r)."""
    w = len(per_rank)
    seq = []
    for t in range(min(len(b) for b in per_rank)):
        for j in range(batch_size):
            seq += [per_rank[r][t][j] for r in range(w) if j < len(per_rank[r][t])]
    return seq


def _take(w: int, batches: int, state=None, n: int = 203, b: int = 4, drop_last: bool = True):
    ds = TensorDataset(torch.arange(n))
    per_rank, states = [], []
    for r in range(w):
        loader = ResumableLoader(ds, b, seed=9, rank=r, world_size=w, drop_last=drop_last)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        per_rank.append([next(it)[0].tolist() for _ in range(batches)])
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # the position is global: the same on every rank
    return per_rank, states[0]


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_two_rank_position_continues_the_global_order_on_another_world_size(new_world):
    k, b = 5, 4
    straight, _ = _take(2, k + 12)
    reference = _global_sequence(straight, b)
    _, state = _take(2, k)
    assert state == {"epoch": 0, "offset": k * 2 * b}
    resumed, _ = _take(new_world, 6, state, drop_last=new_world > 1)
    got = _global_sequence(resumed, b)
    assert got == reference[k * 2 * b: k * 2 * b + len(got)] and len(got) == 6 * new_world * b
    perm = ResumableSampler(203, seed=9).permutation(0).tolist()
    assert got == perm[k * 2 * b: k * 2 * b + len(got)]


def test_drop_last_gives_every_rank_the_same_batch_count_after_an_elastic_resume():
    ds = TensorDataset(torch.arange(1000))
    for w in (1, 2, 3):
        counts = []
        for r in range(w):
            loader = ResumableLoader(ds, 8, rank=r, world_size=w, drop_last=True, epochs=1)
            loader.load_state_dict({"epoch": 0, "offset": 16})  # saved by 2 ranks: not a multiple of 3
            counts.append(sum(1 for _ in loader))
        assert len(set(counts)) == 1 and counts[0] == (1000 - 1000 % w - 16) // (8 * w), (w, counts)


# -- real ranks --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def basics(request, tmp_path_factory) -> list[dict]:
    return run_ranks(request.param, "basics", tmp_path_factory.mktemp(f"basics{request.param}"))


def test_coordinator_collectives(basics):
    w = len(basics)
    for r, rep in enumerate(basics):
        assert (rep["rank"], rep["world_size"], rep["local_rank"]) == (r, w, r)
        assert rep["coordinator"] == "TorchCoordinator" and rep["is_chief"] == (r == 0)
        assert rep["any_last"] is True and rep["any_none"] is False
        assert rep["broadcast"] == {"from": w - 1} and rep["ctx_broadcast"] == 101
        assert rep["all_gather"] == [10 * i for i in range(w)] and rep["allgather"] == [[i] for i in range(w)]
        assert rep["gather"] == ([f"r{i}" for i in range(w)] if r == 0 else None)
        assert rep["gather_last"] == (list(range(w)) if r == w - 1 else None)


def test_wrap_dataset_and_eval_loader_shard_1001_samples(basics):
    w = len(basics)
    shards = [rep["shard"] for rep in basics]
    assert sorted(sum(shards, [])) == list(range(1001))  # disjoint, complete, unpadded
    assert [len(s) for s in shards] == [len(range(r, 1001, w)) for r in range(w)]
    assert all(rep["eval_loader"] == rep["shard"] and rep["unsharded"] == 1001 for rep in basics)


def test_train_loader_gives_equal_batch_counts(basics):
    w = len(basics)
    expected = (1001 - 1001 % w) // (16 * w)
    for rep in basics:
        assert rep["train_len"] == expected and rep["train_batches"] == [16] * expected
    samples = sum((rep["train_samples"] for rep in basics), [])
    assert len(samples) == len(set(samples)) == expected * 16 * w


def test_ddp_keeps_replicas_identical_and_matches_one_process(basics):
    first = basics[0]
    for rep in basics:
        assert rep["wrapped"] == "DistributedDataParallel"
        assert rep["params_after_wrap"] == first["params_after_wrap"]  # rank 0's init everywhere
        assert rep["params_after_train"] == first["params_after_train"]  # bitwise identical replicas
    torch.testing.assert_close(torch.tensor(first["params_after_train"]), torch.tensor(first["params_reference"]))


def test_sync_buffers_gives_every_rank_rank_0s_saved_buffers_only(basics):
    first = basics[0]["synced"]
    assert first["1.running_mean"] == [1.0] * 3 and first["mask"] == [True, False, True] and first["bf16"] == 0.5
    for r, rep in enumerate(basics):
        synced = rep["synced"]
        own = ("0.weight", "0.bias", "cache")
        assert {k: synced[k] for k in synced if k not in own} == \
            {k: first[k] for k in first if k not in own}  # every buffer of any dtype, as rank 0's
        assert synced["0.weight"] == [[float(r)] * 2] * 3  # parameters are not buffers
        assert synced["cache"] == [float(r)] * 2  # a non-persistent buffer is not saved: left alone
        assert rep["synced_extra"] == basics[0]["synced_extra"] == [str(complex(0))] * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, list[dict]]:
    """A 2-rank job trains 3 steps and checkpoints, then the checkpoint resumes on 2, 1 and 3 ranks."""
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = str(root / "model")
    runs = {"saved": run_ranks(2, "ckpt", root / "saved", "save", model_dir)}
    for name, nproc in (("resumed2", 2), ("resumed1", 1), ("resumed3", 3)):
        runs[name] = run_ranks(nproc, "ckpt", root / name, "resume", model_dir)
    runs["state"] = json.loads((root / "model" / "ckpt-3" / "state.json").read_text())["state"]["trainer"]
    return runs


def test_checkpoint_holds_every_ranks_rng_and_resume_restores_each(ckpt):
    assert len(ckpt["state"]["rng"]) == 2
    assert ckpt["state"]["rng"][0] != ckpt["state"]["rng"][1]  # the ranks draw different numbers
    saved, resumed = ckpt["saved"], ckpt["resumed2"]
    for before, after in zip(saved, resumed):
        assert after["step"] == 3 and after["wrapped"] == "DistributedDataParallel"
        assert after["randoms"] == before["randoms"]  # the next numbers of an uninterrupted run
        assert after["ids"] == before["ids"]  # the same batches
        assert after["warnings"] == []
    assert saved[0]["randoms"] != saved[1]["randoms"]
    # and so exactly the same training: dropout masks, data, optimizer state
    assert resumed[0]["params"] == resumed[1]["params"] == saved[0]["params"]


def test_elastic_resume_2_to_1_and_2_to_3_restores_the_saved_ranks_and_seeds_the_new(ckpt):
    saved, one, three = ckpt["saved"], ckpt["resumed1"], ckpt["resumed3"]
    assert one[0]["randoms"] == saved[0]["randoms"]
    assert any("that of rank 1 is not used" in m for m in one[0]["warnings"])
    assert [three[r]["randoms"] for r in (0, 1)] == [saved[r]["randoms"] for r in (0, 1)]
    assert three[1]["warnings"] == []  # rank 0 says once that the world size changed
    assert len(three[0]["warnings"]) == 1 and "not promised to be bit-identical" in three[0]["warnings"][0]
    assert any("none for rank 2 of 3" in m for m in three[2]["warnings"])
    seed_everything(rank_seed(5, 2, 3))  # (seed, rank, global step)
    assert three[2]["randoms"] == [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    assert three[0]["params"] == three[1]["params"] == three[2]["params"]


def test_data_position_continues_the_same_global_order_on_1_2_and_3_ranks(ckpt):
    offset = 3 * 2 * 4  # 3 steps x 2 ranks x batch 4, in global samples
    assert ckpt["state"]["data"] == {"kind": "stateful", "state": {"epoch": 0, "offset": offset}}
    perm = ResumableSampler(203, seed=5).permutation(0).tolist()
    reference = _global_sequence([rep["ids"] for rep in ckpt["saved"]], 4)  # uninterrupted, 2 ranks
    assert reference == perm[offset: offset + len(reference)]
    for name in ("resumed2", "resumed1", "resumed3"):
        got = _global_sequence([rep["ids"] for rep in ckpt[name]], 4)
        assert len(got) == 4 * 4 * len(ckpt[name])
        assert got == perm[offset: offset + len(got)], name
        overlap = min(len(got), len(reference))
        assert got[:overlap] == reference[:overlap], name


def test_cache_dataset_builds_once_for_all_ranks_and_runs(tmp_path):
    root = tmp_path / "cache"
    first = run_ranks(2, "cache", tmp_path / "first", str(root))
    second = run_ranks(3, "cache", tmp_path / "second", str(root))
    builds = (root / "builds.txt").read_text().splitlines()
    # one build of each (on rank 0, in the first run); the bad one is tried by each run's rank 0
    assert builds == ["toy rank0", "local rank0", "bad rank0", "bad rank0"]
    for rep in first + second:
        assert rep["types"] == ["Tensor", "ndarray", "int16", "tuple", "int64", "list"]
        assert rep["x_sum"] == first[0]["x_sum"] and rep["y"] == list(range(10)) and rep["meta"] == ["toy", 1, 2.5]
        assert rep["local"] == [0, 7, 14, 21, 28]  # node-local caches: rank 0 sent its file
        assert rep["bad"].startswith("TypeError:") and "TensorDataset" in rep["bad"]
    assert (root / "node2" / "toy" / "v1" / "data.pt").is_file()
    assert not list(root.rglob(".*tmp*"))
