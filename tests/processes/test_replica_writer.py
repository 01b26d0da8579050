"""One writer for a run of fault-tolerant replica groups (``trainer.fault_tolerance``, torchft 0.2):
every group trains in the same model dir; the group whose chief holds the writer lease commits the
run's checkpoints, the others stand by; the lease passes to a survivor.

One run, two launches of ``cadence launch --replicas 2`` on the same model dir:

1. group 0 (the writer) is killed (SIGKILL) after its first checkpoint: group 1 takes the lease (a
   higher token, its pid) at its next checkpoint and commits from then on; a plain ``cadence train``
   of the model dir is refused (exit 2) while group 1 holds it; the launcher restarts group 0, which
   resumes from the model dir's latest checkpoint, heals from group 1 and commits nothing. Once group
   1 has committed a checkpoint after that, the whole launch is killed (SIGKILL): every group dies.
2. the second launch resumes from the model dir's latest checkpoint and ends at ``train_steps``
   (exit 0, ``FINAL``). Over both launches, every checkpoint step is committed once.

And, with the checkpoint manager alone: a standby writes nothing while a live peer (another
process) holds the lease, takes it once released, and does not commit a step (nor ``FINAL``) twice;
a live plain trainer's lease refuses a replica group.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.copy import JSONState
from cadence.checkpoint.writer_lease import WriterLease
from cadence.checkpoint.writer_turn import WriterTurn
from cadence.errors import CheckpointError, WriterLeaseHeldError
from cli_run import popen, run_cadence
from configs import write_config

pytest.importorskip("torchft")

STEPS = 90
INTERVAL = 6
SAVED = re.compile(r"^\[(group\d)\].*saved checkpoint \S*ckpt-(\d+)", re.MULTILINE)


def committed(output: str) -> list[tuple[str, int]]:
    """``(group, step)`` of each commit the groups logged, in order."""
    return [(group, int(step)) for group, step in SAVED.findall(output)]


def checkpoint_steps(model_dir: Path) -> list[int]:
    root = model_dir / "checkpoints"
    found = root.glob("ckpt-*/MANIFEST.json") if root.is_dir() else []
    return sorted(int(p.parent.name.removeprefix("ckpt-")) for p in found)


def leases(model_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((model_dir / ".writer").glob("lease-*.json"))]


def pid(pids: Path, group: str) -> int | None:
    try:
        return int((pids / group).read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Both launches: what each printed and returned, the leases and group pids seen, and the plain
    ``cadence train`` refused in between."""
    root = tmp_path_factory.mktemp("ft_writer")
    pids = root / "pids"
    pids.mkdir()
    # The restarted group 0 sleeps 3 s first (a restart takes ~1 s here): group 1 has taken the lease
    # by then, at its next checkpoint (~1 s, heartbeat_timeout_s, after the loss, then 6 steps), and
    # is still far from STEPS (at most ~10 steps a second alone; ~25 measured) when group 0 is back.
    config = write_config(root, params={"step_sleep": 0.1, "pid_dir": str(pids), "restart_sleep": 3.0},
                          trainer={"train_steps": STEPS, "steps_per_loop": 3, "checkpoint_interval": INTERVAL,
                                   "validation_interval": None, "max_to_keep": None,
                                   "fault_tolerance": {"replica_groups": 2, "min_replicas": 1,
                                                       "heartbeat_timeout_s": 1.0}})
    model_dir = root / "m"
    launch = ["-m", "cadence", "launch", str(config), "--model-dir", str(model_dir), "--replicas", "2"]
    seen: dict = {}
    log = root / "launch1.log"
    with open(log, "wb") as out:
        proc = popen(launch, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 150

            def wait_for(done) -> None:
                while not done():
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)

            wait_for(lambda: checkpoint_steps(model_dir) and pid(pids, "group1") is not None)
            seen["before"] = leases(model_dir)[-1]  # group 0's, the writer
            seen["group0"], seen["group1"] = pid(pids, "group0"), pid(pids, "group1")
            os.kill(seen["group0"], signal.SIGKILL)
            wait_for(lambda: leases(model_dir)[-1].get("group") == "group1")
            seen["plain"] = run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress",
                                        "--set", "trainer.fault_tolerance=null")
            healed = re.compile(r"replica group 0 healed from a live peer at step (\d+)")
            wait_for(lambda: healed.search(log.read_text().split("restarting it", 1)[-1]))
            at = int(healed.search(log.read_text().split("restarting it", 1)[-1]).group(1))
            wait_for(lambda: max(checkpoint_steps(model_dir)) > at)
            seen["restarted"] = pid(pids, "group0")
            seen["after"] = leases(model_dir)
            seen["latest"] = max(checkpoint_steps(model_dir))
        finally:  # every group dies
            for group in ("group0", "group1"):
                if pid(pids, group) is not None:
                    try:
                        os.kill(pid(pids, group), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seen["output1"] = log.read_text()
    seen["latest"] = max(checkpoint_steps(model_dir))  # a commit may have finished as it was killed
    second = run_cadence(*launch[2:], timeout=150)
    seen["code2"], seen["output2"] = second.returncode, second.stdout + second.stderr
    return model_dir, seen


def test_the_lease_passes_to_the_surviving_group(run):
    model_dir, seen = run
    output = seen["output1"]
    assert seen["before"]["group"] == "group0" and seen["before"]["pid"] == seen["group0"]
    assert "group0 exited with signal SIGKILL; restarting it (1 of 3)" in output
    taken = [lease for lease in seen["after"] if lease["group"] == "group1"]
    assert taken and taken[-1]["pid"] == seen["group1"] and taken[-1]["token"] > seen["before"]["token"], seen
    killed_at = output.index("restarting it")
    by_group1 = [step for group, step in committed(output) if group == "group1"]
    assert by_group1 and min(by_group1) > max(s for g, s in committed(output[:killed_at]) if g == "group0")
    assert not [s for g, s in committed(output[:killed_at]) if g == "group1"]  # a standby until then


def test_the_restarted_writer_resumes_heals_and_stands_by(run):
    model_dir, seen = run
    after = seen["output1"][seen["output1"].index("restarting it"):]
    assert seen["restarted"] != seen["group0"]
    assert re.search(r"\[group0\].*restored checkpoint \S*ckpt-\d+", after), after
    assert "replica group 0 healed from a live peer at step" in after
    assert not [s for g, s in committed(after) if g == "group0"], after  # it committed nothing


def test_a_plain_trainer_is_refused_while_a_group_holds_the_lease(run):
    _, seen = run
    plain = seen["plain"]
    assert plain.returncode == 2, plain.stdout + plain.stderr
    lines = [line for line in plain.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "replica group1" in lines[0] and f"pid {seen['group1']}" in lines[0], plain.stderr


def test_after_every_group_died_the_run_resumes_from_the_model_dir(run):
    model_dir, seen = run
    output = seen["output2"]
    assert seen["code2"] == 0, output
    assert seen["latest"] > 0
    assert re.search(rf"\[group0\].*restored checkpoint \S*ckpt-{seen['latest']}\b", output), output
    assert checkpoint_steps(model_dir)[-1] == STEPS
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == STEPS
    steps = collections.Counter(step for _, step in committed(seen["output1"]) + committed(output))
    assert set(steps.values()) == {1}, steps  # each step committed once
    assert set(steps) <= set(checkpoint_steps(model_dir)) and STEPS in steps
    assert min(s for _, s in committed(output)) > seen["latest"]
    assert not list((model_dir / "replicas").rglob("checkpoints"))
    rows = [json.loads(line) for line in (model_dir / "replicas/group1/train/metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == STEPS
    assert (model_dir / "train" / "metrics.jsonl").is_file()


HOLDER = """
import sys
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.copy import JSONState
from cadence.checkpoint.writer_turn import WriterTurn
turn = WriterTurn.start(sys.argv[1], "group0", ttl=60, first=True)
manager = CheckpointManager(sys.argv[1] + "/checkpoints", turn=turn)
manager.save(4, {"x": JSONState({"by": "group0"})})
manager.mark_final(4)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
manager.close()
turn.release()
"""


def test_a_standby_writes_nothing_until_it_holds_the_lease_and_commits_no_step_twice(tmp_path):
    model_dir = tmp_path / "m"
    holder = popen(["-c", HOLDER, str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        final = (model_dir / "checkpoints" / "FINAL").read_text()
        with pytest.raises(WriterLeaseHeldError, match=rf"replica group0, pid {holder.pid}\b"):
            WriterLease.acquire(str(model_dir))  # a plain trainer is refused
        turn = WriterTurn.start(str(model_dir), "group1", ttl=60, first=True)  # a live peer: it stands by
        manager = CheckpointManager(str(model_dir / "checkpoints"), turn=turn)
        assert turn.standby
        manager.save(8, {"x": JSONState({"by": "group1"})})
        assert manager.begin(8) is None and manager.steps() == [4]  # nothing written
        manager.mark_final(8)
        manager.clear_final()
        with pytest.raises(CheckpointError, match="stands by"):
            manager.delete(4)
        assert len(leases(model_dir)) == 1 and (model_dir / "checkpoints" / "FINAL").read_text() == final
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert leases(model_dir)[-1]["released"]
    manager.save(4, {"x": JSONState({"by": "group1"})})  # takes the lease: the step is committed already
    assert not turn.standby and leases(model_dir)[-1]["group"] == "group1"
    manager.mark_final(4)
    assert manager.read_state(4)["state"]["x"] == {"by": "group0"}
    assert (model_dir / "checkpoints" / "FINAL").read_text() == final
    manager.save(8, {"x": JSONState({"by": "group1"})})
    assert manager.steps() == [4, 8] and manager.read_state(8)["state"]["x"] == {"by": "group1"}
    manager.close()
    turn.release()


PLAIN_HOLDER = """
import sys
from cadence.checkpoint.writer_lease import WriterLease
lease = WriterLease.acquire(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
lease.release()
"""


def test_a_replica_group_is_refused_by_a_plain_trainers_lease(tmp_path):
    holder = popen(["-c", PLAIN_HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(WriterLeaseHeldError, match=rf"being written by pid {holder.pid}\b"):
            WriterTurn.start(str(tmp_path), "group1", ttl=60, first=False)
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
