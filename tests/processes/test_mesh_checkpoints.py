"""Checkpoints of a device mesh (issue 41, item 6), through the CLI on gloo CPU processes.

One 4-rank TP+FSDP run (dp_shard 2 x tp 2, ``TPTask``) is resumed along a chain of meshes: (dp_shard 4),
one process, HSDP (dp_replicate 2 x dp_shard 2), then (dp_replicate 2 x tp 2); right after each restore
the run writes its full model and optimizer state (``task.params.restored_to``), which must be the
source checkpoint's bit for bit. The TP+FSDP checkpoints are evaluated (one process, two, the sidecar),
exported as the full model that loads into the plain module, and listed by ``cadence ls``. On each
4-rank mesh a run killed with SIGKILL and resumed on that mesh ends bit-identical to the run without the
kill (the chain's link on that mesh).
"""

from __future__ import annotations

import json
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cadence.summaries.metrics_file import read_metrics
from cli_run import checkpoint_weights, killed_after, run_cadence, same_weights
from configs import write_config

cadence = partial(run_cadence, env={"COLUMNS": "200"})
TASK = "tp_tasks.py:TPTask"
TP_FSDP = {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
CHAIN = [  # (mesh, processes, the link's last step): each link resumes the one before; checkpoints every 2 steps.
    # The links on a mesh with a kill test train 10 steps: killed 0.2 s after their first checkpoint, 8 steps
    # of 0.05 s each are left (cli_run.killed_after)
    ({"dp_replicate": 1, "dp_shard": 4, "tp": 1}, 4, 14),
    ({"dp_replicate": 1, "dp_shard": 1, "tp": 1}, 1, 16),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 1}, 4, 26),
    ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, 4, 36),
]
HSDP, DP_REPLICATE_TP = CHAIN[2][0], CHAIN[3][0]  # the chain's links with a kill test


def mesh_sets(mesh: dict[str, int]) -> list[str]:
    """The ``--set``s of a link on ``mesh``; HSDP's and (dp_replicate 2 x tp 2)'s train in bf16 (FSDP2's
    mixed precision, and autocast), so that bf16 is resumed exactly on those meshes too."""
    bf16 = ["trainer.precision=bf16"] if mesh in (HSDP, DP_REPLICATE_TP) else []
    return [f"trainer.parallel.{k}={v}" for k, v in mesh.items()] + bf16


def train(config: Path, model_dir: Path, nproc: int, *sets: str) -> str:
    args = [a for s in sets for a in ("--set", s)]
    proc = cadence("train", str(config), "--model-dir", str(model_dir), "--nproc", str(nproc), "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the log lines unwrapped: torchrun's --tee puts "[rankN]:" before each line, a wrapped line's too
    lines = (re.sub(r"^\[rank\d+\]:", "", line) for line in (proc.stdout + proc.stderr).splitlines())
    return " ".join(" ".join(lines).split())


def ckpt(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"ckpt-{step}"


def checkpoint_optimizer(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full optimizer state of ``checkpoint`` as ``{"<param fqn>.<name>": tensor}``: assembled from the
    ranks' shards (DCP), or read from ``optimizer.safetensors`` (keyed by parameter index: TPTask's
    parameters in order)."""
    from cadence.torch.checkpoint_io.sharded import read_model_state

    if not (checkpoint / "optimizer.safetensors").exists():
        return {k[len("state."):]: v for k, v in read_model_state(str(checkpoint), key="optimizer").items()}
    from cadence.torch.checkpoint_io.tensor_tree import load_tree
    from tp_tasks import TPTask

    names = [name for name, _ in TPTask().build_model().named_parameters()]
    data = (checkpoint / "optimizer.safetensors").read_bytes()
    state = load_tree(data, source=str(checkpoint))["optimizer"]["state"]
    return {f"{names[index]}.{key}": value for index, values in state.items() for key, value in values.items()}


def world(mesh: dict[str, int]) -> int:
    return mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"]


def described(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(config, model_dir, chain)``: a 4-rank (dp_shard 2 x tp 2) run to step 12, checkpoints at 4, 8, 12;
    ``chain`` is a copy of its model dir taken at once (the chain resumes it; the other tests read the run)."""
    tmp = tmp_path_factory.mktemp("mesh-checkpoints")
    (tmp / "seen").mkdir()  # each rank's training batches (a digest each), for the data test
    config = write_config(tmp, TASK, params={"digest_dir": str(tmp / "seen")},
                          trainer={"train_steps": 12, "checkpoint_interval": 4, "steps_per_loop": 2,
                                   "validation_interval": 4, "parallel": TP_FSDP})
    run = tmp / "run"
    train(config, run, 4)
    shutil.copytree(tmp / "seen", tmp / "seen-run")  # this run's alone (the other runs add theirs)
    chain = tmp / "chain"
    shutil.copytree(run, chain)
    return config, run, chain



def test_the_ranks_of_a_tp_group_read_the_same_batches_and_each_rank_writes_its_shards(tp_run):
    """dp_shard 2 x tp 2: ranks 0-1 and 2-3 are the TP groups (tp is the fastest dimension): the same
    batches within one, different ones across the data-parallel dimension; every rank its DCP file."""
    _, run, _ = tp_run
    ranks = [(run.parent / "seen-run" / f"rank{r}").read_text().split() for r in range(4)]
    assert all(len(r) == 12 for r in ranks)
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]
    assert not set(ranks[0]) & set(ranks[2])
    last = ckpt(run, 12)
    assert sorted(p.name for p in last.iterdir() if p.name.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert {k: tuple(v.shape) for k, v in checkpoint_weights(last).items()} == {
        "0.weight": (16, 8), "0.bias": (16,), "2.weight": (2, 16), "2.bias": (2,)}

@pytest.fixture(scope="module")
def chain(tp_run) -> dict[str, object]:
    """The chain of resumes: each link's restored state (``restored``), output (``text``) and, before the
    links on a mesh with a kill test, a copy of the model dir (``before``: mesh -> (copy, the step the link
    starts from, its last step))."""
    config, _, model_dir = tp_run
    links, before = [], {}
    source = 12
    for mesh, nproc, last in CHAIN:
        if mesh in (HSDP, DP_REPLICATE_TP):
            copy = model_dir.parent / f"before-{len(links)}"
            shutil.copytree(model_dir, copy)
            before[json.dumps(mesh)] = (copy, source, last)
        restored = model_dir.parent / f"restored-{len(links)}.pt"
        text = train(config, model_dir, nproc, *mesh_sets(mesh), f"trainer.train_steps={last}",
                     "trainer.checkpoint_interval=2", f"task.params.restored_to={restored}")
        links.append({"mesh": mesh, "nproc": nproc, "source": source, "last": last, "text": text,
                      "restored": torch.load(restored, weights_only=True)})
        source = last
    return {"config": config, "model_dir": model_dir, "links": links, "before": before}


def test_a_tp_fsdp_checkpoint_reshards_along_a_chain_of_meshes_bit_identically(chain):
    model_dir = chain["model_dir"]
    previous = TP_FSDP
    for link in chain["links"]:
        source = ckpt(model_dir, link["source"])
        restored = link["restored"]
        assert restored["step"] == link["source"]
        # the full tensors the run holds right after the load are the source checkpoint's, bit for bit
        assert same_weights(restored["model"], checkpoint_weights(source)), link["mesh"]
        saved = checkpoint_optimizer(source)
        assert {k.rsplit(".", 1)[1] for k in saved} == {"step", "exp_avg", "exp_avg_sq"}
        assert same_weights(restored["optimizer"], saved), link["mesh"]
        # it trained on to its last step; its checkpoints are sharded on 4 ranks, plain on one
        last = ckpt(model_dir, link["last"])
        shards = sorted(p.name for p in last.iterdir() if p.name.endswith(".distcp"))
        assert shards == ([f"__{r}_0.distcp" for r in range(4)] if link["nproc"] == 4 else [])
        assert (last / "model.safetensors").exists() == (link["nproc"] == 1)
        state = json.loads((last / "state.json").read_text())["state"]["trainer"]
        assert state["mesh"] == link["mesh"]
        position = state["data"]["state"]  # in global samples (8 a step, 128 an epoch), whatever the mesh
        assert position["epoch"] * 128 + position["offset"] == link["last"] * 8, position
        text = link["text"]
        if world(previous) == link["nproc"]:  # the world size stayed, the mesh changed
            assert f"saved on the mesh {described(previous)}, resumed on {described(link['mesh'])}" in text, text
        else:
            assert f"saved by {world(previous)} rank(s), resumed on {link['nproc']}" in text, text
        assert "not promised to be bit-identical" in text
        previous = link["mesh"]


@pytest.mark.parametrize("mesh", [TP_FSDP, HSDP, DP_REPLICATE_TP], ids=["dp_shard2-tp2", "hsdp", "dp_replicate2-tp2"])
def test_a_run_killed_on_a_mesh_resumes_on_it_bit_identical(tmp_path, tp_run, chain, mesh):
    config, straight, _ = tp_run
    sets = mesh_sets(mesh)
    if mesh == TP_FSDP:  # from the start; the run without the kill is tp_run's
        run, first, last = tmp_path / "run", 4, 12
    else:  # from the chain's model dir before its link on this mesh; the run without the kill is that link
        copy, start, last = chain["before"][json.dumps(mesh)]
        run, first = shutil.copytree(copy, tmp_path / "run"), start + 2
        straight = chain["model_dir"]
        sets += [f"trainer.train_steps={last}", "trainer.checkpoint_interval=2"]
    args = [a for s in sets for a in ("--set", s)]
    killed_after(config, run, first, last, "--nproc", "4", *args)
    text = train(config, run, 4, *sets)
    assert "restored checkpoint" in text and "not promised" not in text
    assert same_weights(checkpoint_weights(ckpt(run, last)), checkpoint_weights(ckpt(straight, last)))
    assert same_weights(checkpoint_optimizer(ckpt(run, last)), checkpoint_optimizer(ckpt(straight, last)))


def test_evaluate_on_one_and_two_processes_and_the_sidecar_read_the_tp_checkpoints(tmp_path, tp_run):
    config, reference, _ = tp_run
    run = shutil.copytree(reference, tmp_path / "run")
    in_process = {r["step"]: r for r in read_metrics(run / "eval")}  # the 4-rank run's own evaluations
    one = cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "8")
    two = cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "8", "--nproc", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stdout + one.stderr + two.stdout + two.stderr
    single, double = json.loads(one.stdout), json.loads(two.stdout)
    assert single["step"] == double["step"] == 8
    assert double == pytest.approx(single, rel=1e-6)
    assert single["accuracy"] == in_process[8]["accuracy"]  # the plain model evaluates as the 4 ranks did
    assert single["loss"] == pytest.approx(in_process[8]["loss"], rel=1e-6)

    sidecar = cadence("evaluate", str(config), "--model-dir", str(run), "--continuous")
    assert sidecar.returncode == 0, sidecar.stdout + sidecar.stderr
    rows = read_metrics(run / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(4, "evaluated"), (8, "evaluated"), (12, "evaluated")]
    for row in rows:
        assert row["metrics"]["accuracy"] == in_process[row["step"]]["accuracy"]


def test_export_writes_the_full_model_that_loads_into_the_plain_module_and_ls_lists_the_shards(tmp_path, tp_run):
    from tp_tasks import TPTask

    _, run, _ = tp_run
    out = tmp_path / "export"
    proc = cadence("export", str(run), "--checkpoint", "12", "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exported = load_file(out / "model.safetensors")
    assert same_weights(exported, checkpoint_weights(ckpt(run, 12)))  # full, unsharded tensors
    plain = TPTask().build_model()
    plain.load_state_dict(exported, strict=True)
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())

    listed = cadence("ls", str(run), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(r["step"], r["ranks"]) for r in rows] == [(4, 4), (8, 4), (12, 4)]
    table = cadence("ls", str(run))
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if line.lstrip().startswith("12 "))
    assert "sharded (4 ranks)" in line and "final" in line, table.stdout
