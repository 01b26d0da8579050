"""Replica groups of several ranks (``trainer.fault_tolerance`` with ``strategy: fsdp``, torchft 0.2):
``cadence launch --replicas 2 --nproc 2`` -- 2 groups of 2 FSDP ranks, a real lighthouse, gloo -- in one
run, beside a plain 4-rank FSDP run of the same global batch:

- both groups start in the same quorum (the task's ``start_together``); group 0's checkpoint at step 6,
  before any fault, matches the plain run's (tolerance below), which the plain run's step 3 does not
  (so the comparison can fail);
- then rank 1 of group 1 is killed (SIGKILL): torchrun takes group 1 down, the launcher starts it
  again; group 0 goes on in the same processes, alone (``replicas: 1``), and is held mid-step
  (``hold_file``) until the restarted group has reached its first step, so that group 1 rejoins and
  heals from group 0 -- each rank from the rank of equal group rank, its FSDP shards and Adam state
  as local shards -- mid-run; the run ends with exit 0, every loop logged once;
- (no process) every rank of a group refuses a lighthouse nobody listens on (one line, exit 2 from
  the CLI); the data split over 2 groups of a dp_shard x tp mesh.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cadence.cluster.replica_groups import free_port
from cli_run import checkpoint_weights, popen
from configs import write_config

pytest.importorskip("torchft")

NOBODY = f"http://127.0.0.1:{free_port()}"  # a lighthouse address nobody listens on
STEPS = 42
COMPARED = 6  # group 0's checkpoint before the kill, compared with the plain run's
TOLERANCE = 1e-6
"""Max absolute difference of any weight between group 0 of the 2 x 2 run and the plain 4-rank FSDP
run after COMPARED Adam steps. Measured: 3e-8 (the same data shards and dropout draws; an average over
2 ranks then over 2 groups sums in another order than one over 4 ranks); the plain run's own weights
3 steps apart differ by ~4e-2."""


def metrics(model_dir: Path) -> list[dict]:
    path = model_dir / "train" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(proc: subprocess.Popen, log: Path, what, deadline: float) -> None:
    while not what():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """The 2 x 2 run with rank 1 of group 1 killed after group 0's checkpoint at step COMPARED, and the
    plain 4-rank run (started once the rank is killed); (root, launch output, exit code, group 0's pids
    when killed and at the end)."""
    root = tmp_path_factory.mktemp("ft_mesh")
    pids, hold = root / "pids", root / "hold"
    pids.mkdir()
    params = {"step_sleep": 0.1, "pid_dir": str(pids), "hold_file": str(hold), "start_together": 4}
    trainer = {"train_steps": STEPS, "steps_per_loop": 3, "checkpoint_interval": COMPARED,
               "validation_interval": None, "strategy": "fsdp"}
    # join_timeout_s: at the first quorum the lighthouse waits this long for a group it hears from but
    # that has not asked yet (start_together makes them ask within moments); later, with 2 groups, the
    # split-brain rule decides, not this
    config = write_config(root / "ft", params=params, trainer={
        **trainer, "fault_tolerance": {"replica_groups": 2, "min_replicas": 1, "heartbeat_timeout_s": 1.0,
                                       "join_timeout_s": 10.0, "timeout_s": 10.0}})
    plain = write_config(root / "plain", trainer={**trainer, "train_steps": COMPARED, "checkpoint_interval": 3})
    model_dir, log = root / "model", root / "launch.log"
    group0 = [pids / "group0rank0", pids / "group0rank1"]
    with open(log, "wb") as out:
        proc = popen(["-m", "cadence", "launch", str(config), "--model-dir", str(model_dir), "--replicas", "2",
                      "--nproc", "2"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        plain_run = None
        try:
            deadline = time.monotonic() + 150
            wait_for(proc, log, lambda: (model_dir / "checkpoints" / f"ckpt-{COMPARED}").is_dir(), deadline)
            before = [p.read_text() for p in group0]
            os.kill(int((pids / "group1rank1").read_text()), signal.SIGKILL)
            plain_run = popen(["-m", "cadence", "train", str(plain), "--model-dir", str(root / "plain_model"),
                               "--nproc", "4", "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
            wait_for(proc, log, lambda: 1.0 in [r.get("replicas") for r in metrics(model_dir)], deadline)
            hold.touch()  # group 0 stops at its next step until the restarted group 1 is about to take its first
            wait_for(proc, log, lambda: len(re.findall(r"\[group1\] .*sanity check", log.read_text())) >= 2, deadline)
            hold.unlink()
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            _, err = plain_run.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert plain_run.returncode == 0, err.decode()
        finally:
            for p in (proc, plain_run):
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return root, log.read_text(), code, before, [p.read_text() for p in group0]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_two_fsdp_groups_before_a_fault_match_one_four_rank_fsdp_job(mesh_run):
    root = mesh_run[0]
    ft = checkpoint_weights(root / "model" / "checkpoints" / f"ckpt-{COMPARED}")
    same = checkpoint_weights(root / "plain_model" / "checkpoints" / f"ckpt-{COMPARED}")
    earlier = checkpoint_weights(root / "plain_model" / "checkpoints" / f"ckpt-{COMPARED // 2}")
    print(f"2 x 2 FSDP vs 4-rank FSDP at step {COMPARED}: {max_difference(ft, same):.3g}; "
          f"vs 4-rank FSDP {COMPARED // 2} steps earlier: {max_difference(ft, earlier):.3g}")
    assert max_difference(ft, same) <= TOLERANCE
    assert max_difference(ft, earlier) > 100 * TOLERANCE  # the comparison can fail
    rows = metrics(root / "model")
    assert [r["replicas"] for r in rows if r["step"] <= COMPARED] == [2.0, 2.0]  # both groups from step 1


def test_a_rank_killed_in_a_group_of_two_costs_the_other_group_nothing_and_the_group_heals(mesh_run):
    root, output, code, group0_before, group0_after = mesh_run
    assert code == 0, output
    assert group0_before == group0_after  # group 0's ranks were never restarted
    assert re.search(r"group1 exited with .*; restarting it \(1 of 3\)", output), output
    assert "group0 exited" not in output
    assert "killed by SIGKILL" in output  # torchrun's report of group 1's rank 1, through cadence train
    rows = metrics(root / "model")
    assert [r["step"] for r in rows] == list(range(3, STEPS + 1, 3))  # every loop once, the same processes
    replicas = [r["replicas"] for r in rows]
    alone = [i for i, n in enumerate(replicas) if n == 1]
    assert alone and 2 in replicas[alone[-1]:], replicas  # group 0 alone, then group 1 back
    healed = [int(m) for m in re.findall(r"replica group 1 healed from a live peer at step (\d+)", output)]
    assert healed and healed[-1] > COMPARED, output  # the restarted group took group 0's state mid-run
    assert (root / "model" / "checkpoints" / f"ckpt-{STEPS}").is_dir()
    assert not (root / "model" / "replicas" / "group1" / "checkpoints").exists()  # one writer: group 0's chief
    assert metrics(root / "model" / "replicas" / "group1")[-1]["step"] == STEPS  # group 1's own outputs
    state = json.loads((root / "model" / "checkpoints" / f"ckpt-{STEPS}" / "state.json").read_text())
    shards = state["state"]["trainer"]["replica_data"]  # every data shard's position: 2 groups x 2 ranks
    assert len(shards) == 4 and shards[0]["samples"] == shards[1]["samples"] > shards[2]["samples"], shards


def test_every_rank_of_a_group_refuses_a_lighthouse_nobody_listens_on(tmp_path):
    """Only a group's rank 0 talks to the lighthouse; every rank checks it first (before anything is
    built), so that a group of several ranks ends with the one line, exit 2, not with rank 1's failure
    on the store that rank 0 took down with it (no process: the context alone)."""
    from cadence.config.components.fault_tolerance import FaultToleranceConfig
    from cadence.errors import ConfigError
    from cadence.torch.fault_tolerance import join_replica_groups
    from cadence.torch.runtime.context import Context

    config = FaultToleranceConfig(replica_groups=2, replica_id=1, lighthouse=NOBODY, connect_timeout_s=0.3)
    ctx = Context(rank=1, world_size=2, device="cpu")
    with pytest.raises(ConfigError, match=f"cannot reach the lighthouse at {re.escape(NOBODY)} within 0.3 s"):
        join_replica_groups(config, ctx)
    assert ctx.replica_groups == 1  # nothing set


def test_each_groups_mesh_reads_its_own_share_of_the_data():
    """2 groups of a dp_shard 2 x tp 2 mesh: the 4 data-parallel ranks of all groups read 4 different
    shards, and the 2 ranks of a tensor-parallel pair the same one (no process: the context alone)."""
    from cadence.config.components.fault_tolerance import FaultToleranceConfig
    from cadence.torch.fault_tolerance import join_replica_groups
    from cadence.torch.parallel.mesh import resolve_degrees
    from cadence.torch.runtime.context import Context

    degrees = resolve_degrees(1, 2, 2, 4)
    shards = {}
    with socket.socket() as listening:  # a lighthouse to reach (join_replica_groups checks it is there)
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        address = f"http://127.0.0.1:{listening.getsockname()[1]}"
        for group in range(2):
            for rank in range(4):
                ctx = Context(rank=rank, world_size=4, device="cpu")
                ctx.use_mesh(None, degrees.dp_rank(rank), degrees.dp_size)
                join_replica_groups(FaultToleranceConfig(replica_groups=2, replica_id=group, lighthouse=address), ctx)
                shards[group, rank] = ctx.data_shard()
    assert {count for _, count in shards.values()} == {4}
    assert sorted(index for index, _ in shards.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(shards[g, r] == shards[g, r ^ 1] for g, r in shards)  # a TP pair: ranks 2k, 2k + 1

