"""The writer lease (one trainer per model dir): real processes holding, racing for, dying with and
losing the lease; fenced commits; and two ``cadence train`` on one model dir, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager, JSONState
from cadence.checkpoint.writer_lease import WriterLease, check_free, current_lease, take_over
from cadence.errors import WriterLeaseHeldError, WriterLeaseLostError
from cadence.storage import Storage
from cli_run import ENV, popen, run_torchrun
from cli_run import run_cadence as cadence
from configs import write_config as tiny_config

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"

HOLDER = """
import sys, time
from cadence.checkpoint import CheckpointManager, JSONState
from cadence.checkpoint.writer_lease import WriterLease
model_dir, ttl = sys.argv[1], float(sys.argv[2])
lease = WriterLease.acquire(model_dir, ttl=ttl)
print("ready", lease.token, flush=True)
command = sys.stdin.readline().strip()
if command == "save":
    try:
        manager = CheckpointManager(model_dir + "/checkpoints", fence=lease)
        manager.save(7, {"s": JSONState({"x": 1})})
        print("saved", flush=True)
    except Exception as e:
        print(type(e).__name__, e, flush=True)
elif command == "release":
    lease.release()
    print("released", flush=True)
"""


def hold(model_dir: Path, ttl: float = 60.0, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """A process holding ``model_dir``'s writer lease; waits for a command on stdin."""
    proc = popen(["-c", HOLDER, str(model_dir), str(ttl)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.stderr.read()
    return proc, int(line.split()[1])


def command(proc: subprocess.Popen, what: str) -> str:
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    out = proc.stdout.readline().strip()
    proc.wait(timeout=30)
    return out


def lease_files(model_dir: Path) -> list[str]:
    return sorted(p.name for p in (model_dir / ".writer").iterdir())


# ------------------------------------------------------------------ acquiring and refusing


def test_a_live_holder_refuses_a_second_writer_naming_it(tmp_path):
    proc, token = hold(tmp_path)
    try:
        with pytest.raises(WriterLeaseHeldError) as caught:
            WriterLease.acquire(str(tmp_path))
        message = str(caught.value)
        assert f"pid {proc.pid} on host {os.uname().nodename} since " in message
        assert f"writer lease {token}" in message and "--take-over" in message and "\n" not in message
        with pytest.raises(WriterLeaseHeldError):
            check_free(str(tmp_path))
        assert lease_files(tmp_path) == ["lease-000000000001.json"]  # the refused one wrote nothing
    finally:
        assert command(proc, "release") == "released"
    lease = WriterLease.acquire(str(tmp_path))  # released: free at once
    assert lease.token == token + 1
    lease.release()


def test_release_hands_over_at_once_and_old_files_are_pruned(tmp_path):
    tokens = []
    for _ in range(4):
        with WriterLease.acquire(str(tmp_path)) as lease:
            tokens.append(lease.token)
    assert tokens == [1, 2, 3, 4]
    assert lease_files(tmp_path) == ["lease-000000000003.json", "lease-000000000004.json"]  # this and the previous
    record = current_lease(str(tmp_path))
    assert record is not None and record.released and record.pid == os.getpid()


def test_a_holder_killed_on_this_host_is_replaced_at_once(tmp_path):
    proc, token = hold(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    held = current_lease(str(tmp_path))
    assert held is not None and held.held(time.time())  # unreleased, unexpired: only its pid is gone
    lease = WriterLease.acquire(str(tmp_path))
    assert lease.token == token + 1
    lease.release()


def test_the_same_job_takes_over_its_earlier_attempt(tmp_path, monkeypatch):
    proc, _ = hold(tmp_path, env={"CADENCE_JOB_ID": "job-a"})
    try:
        monkeypatch.setenv("CADENCE_JOB_ID", "job-b")
        with pytest.raises(WriterLeaseHeldError):
            WriterLease.acquire(str(tmp_path))
        monkeypatch.setenv("CADENCE_JOB_ID", "job-a")  # a restart of the same job (torchelastic stopped it)
        lease = WriterLease.acquire(str(tmp_path))
        lease.release()
    finally:
        proc.kill()
        proc.wait()


RACER = """
import sys, time
from pathlib import Path
from cadence.checkpoint.writer_lease import WriterLease
from cadence.errors import WriterLeaseHeldError
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
try:
    lease = WriterLease.acquire(sys.argv[1])
    print("won", lease.token, flush=True)
    time.sleep(2)
except WriterLeaseHeldError as e:
    print("held", e, flush=True)
"""


def test_of_processes_racing_for_a_free_lease_exactly_one_wins(tmp_path):
    for round_ in range(2):  # a first lease, then a released one: both are raced for
        go = tmp_path / f"go{round_}"
        racers = [popen(["-c", RACER, str(tmp_path / "m"), str(go)], stdout=subprocess.PIPE, text=True)
                  for _ in range(6)]
        time.sleep(2.0)  # all started and polling
        go.touch()
        outs = [r.communicate(timeout=60)[0] for r in racers]
        winners = [o for o in outs if o.startswith("won")]
        assert len(winners) == 1, outs
        assert all(o.startswith("held") and "is being written by" in o for o in outs if o not in winners)
        assert current_lease(str(tmp_path / "m")).token == int(winners[0].split()[1]) == round_ + 1


def test_an_unreadable_newest_lease_counts_as_held(tmp_path):
    with WriterLease.acquire(str(tmp_path)):
        pass
    (tmp_path / ".writer" / "lease-000000000002.json").write_text("{torn")
    with pytest.raises(WriterLeaseHeldError, match="writer lease 2"):
        WriterLease.acquire(str(tmp_path))


# ------------------------------------------------------------------ fencing


def test_a_fenced_off_holder_commits_nothing(tmp_path):
    """Within one process the newer acquisition wins: the older lease is fenced off, and a
    manager committing under it raises before the manifest, leaving nothing behind."""
    old = WriterLease.acquire(str(tmp_path))
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=1, fence=old)
    manager.save(1, {"s": JSONState({"x": 1})})
    new = WriterLease.acquire(str(tmp_path))
    assert new.token == old.token + 1
    with pytest.raises(WriterLeaseLostError, match=r"not allowed to save: lost the writer "
                                                   rf"lease {old.token}: pid {os.getpid()} on host .* holds it"):
        manager.save(2, {"s": JSONState({"x": 2})})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt-1"]
    for fenced in (lambda: manager.delete(1), lambda: manager.mark_final(1)):
        with pytest.raises(WriterLeaseLostError):
            fenced()
    assert (tmp_path / "checkpoints" / "ckpt-1" / "MANIFEST.json").exists()
    CheckpointManager(str(tmp_path / "checkpoints"), fence=new).save(2, {"s": JSONState({"x": 2})})
    new.release()
    old.release()  # lost: nothing written
    assert current_lease(str(tmp_path)).token == new.token


class TakenOverWhileSaving:
    """Writes its file; meanwhile another acquisition takes the lease (as one on another host would)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.newer: WriterLease | None = None

    def save_checkpoint(self, writer):
        writer.write("blob.bin", b"x" * 1000)
        self.newer = WriterLease.acquire(str(self.model_dir))
        return {"ok": True}


def test_a_lease_lost_during_a_save_is_checked_right_before_the_commit(tmp_path):
    lease = WriterLease.acquire(str(tmp_path))
    manager = CheckpointManager(str(tmp_path / "checkpoints"), fence=lease)
    obj = TakenOverWhileSaving(tmp_path)
    with pytest.raises(WriterLeaseLostError, match=r"not allowed to commit checkpoint .*ckpt-3: lost the writer lease"):
        manager.save(3, {"obj": obj})
    assert os.listdir(tmp_path / "checkpoints") == []  # the written files went with the temp dir
    assert obj.newer is not None
    obj.newer.release()


def test_an_expired_holder_is_taken_over_and_then_cannot_commit(tmp_path):
    """A holder frozen (SIGSTOP) past its ttl: another process acquires; once thawed, the old
    holder's save fails and commits nothing."""
    proc, token = hold(tmp_path, ttl=1.0)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(WriterLeaseHeldError):
            WriterLease.acquire(str(tmp_path), ttl=1.0)
        time.sleep(1.3)
        lease = WriterLease.acquire(str(tmp_path), ttl=5.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out = command(proc, "save")
    assert out.startswith("WriterLeaseLostError") and f"lost the writer lease {token}" in out, out
    assert not (tmp_path / "checkpoints" / "ckpt-7").exists()
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("ckpt-")]
    lease.release()


def test_take_over_fences_off_a_live_holder(tmp_path):
    proc, token = hold(tmp_path)
    taken = take_over(str(tmp_path))
    assert taken is not None and taken.pid == proc.pid
    lease = WriterLease.acquire(str(tmp_path))
    assert lease.token == token + 2  # token + 1 is the take-over record
    out = command(proc, "save")
    assert out.startswith("WriterLeaseLostError") and "holds it since" in out and f"(writer lease {token + 2})" in out
    lease.release()
    assert take_over(str(tmp_path)) is None  # nobody holds it now


def test_create_exclusive_creates_once(tmp_path):
    for url in (str(tmp_path / "f"), "memory://cadence-lease-test/f"):
        storage = Storage(url)
        assert storage.create_exclusive(storage.root, b"one")
        assert not storage.create_exclusive(storage.root, b"two")
        assert storage.read_bytes(storage.root) == b"one"
    assert sorted(os.listdir(tmp_path)) == ["f"]  # no temp file left


# ------------------------------------------------------------------ through the CLI


def write_config(tmp_path: Path, steps: int = 40, step_sleep: float = 0.0, hold_file: Path | None = None) -> Path:
    params = {"step_sleep": step_sleep, **({"hold_file": str(hold_file)} if hold_file else {})}
    return tiny_config(tmp_path, TASK, params=params, trainer={
        "train_steps": steps, "steps_per_loop": 5, "checkpoint_interval": 10, "validation_interval": 20,
        "max_to_keep": 2, "seed": 3})


def start_training(config: Path, model_dir: Path) -> subprocess.Popen:
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(model_dir), "--no-progress"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = model_dir / "checkpoints" / "ckpt-10" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manifest.exists(), proc.communicate()[1]
    return proc


def one_line(stderr: str) -> str:
    return " ".join(stderr.split())


def test_a_second_cadence_train_exits_2_naming_the_first(tmp_path):
    # the first trainer is held mid-way (TinyTask's hold_file) while the CLI is refused twice
    hold = tmp_path / "hold"
    config, run = write_config(tmp_path, steps=200, step_sleep=0.02, hold_file=hold), tmp_path / "run"
    first = start_training(config, run)
    hold.touch()
    saved_config = (run / "config.yaml").read_bytes()
    second = cadence("train", str(config), "--model-dir", str(run))
    assert second.returncode == 2, second.stderr
    assert "Traceback" not in second.stderr
    assert f"is being written by pid {first.pid} on host" in one_line(second.stderr)
    assert "--take-over" in second.stderr
    assert (run / "config.yaml").read_bytes() == saved_config  # the refused trainer wrote nothing
    # the same, refused before any rank starts, for a multi-process job
    multi = cadence("train", str(config), "--model-dir", str(run), "--nproc", "2")
    assert multi.returncode == 2 and f"pid {first.pid}" in one_line(multi.stderr), multi.stderr
    assert "Traceback" not in multi.stderr
    assert first.poll() is None
    hold.unlink()
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 200
    verified = cadence("ls", str(run), "--verify")
    assert verified.returncode == 0 and "CORRUPT" not in verified.stdout, verified.stdout
    assert current_lease(str(run)).released  # the finished trainer let it go


def test_take_over_stops_the_old_trainer_at_its_next_commit_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    assert cadence("train", str(write_config(tmp_path, steps=60)), "--model-dir", str(straight)).returncode == 0
    config, run = write_config(tmp_path, steps=60, step_sleep=0.15), tmp_path / "run"
    first = start_training(config, run)
    second = cadence("train", str(config), "--model-dir", str(run), "--take-over", "--set", "task.params.step_sleep=0")
    assert second.returncode == 0, second.stderr
    _, err = first.communicate(timeout=180)
    assert first.returncode == 1, err
    assert "lost the writer lease" in one_line(err) and "Traceback" not in err
    final = "checkpoints/ckpt-60/model.safetensors"
    assert (run / final).read_bytes() == (straight / final).read_bytes()  # nothing of the old trainer after it
    assert cadence("ls", str(run), "--verify").returncode == 0


def test_the_ranks_of_a_job_all_refuse_when_another_trainer_holds_the_lease(tmp_path):
    """Under an external torchrun (no parent check): the chief's refusal reaches every rank."""
    proc, _ = hold(tmp_path / "run")
    try:
        config = write_config(tmp_path, steps=10)
        job = run_torchrun(2, "-m", "cadence", "train", str(config), "--model-dir", str(tmp_path / "run"),
                           "--no-progress", tee=3, timeout=180, external=True)
        assert job.returncode != 0
        text = one_line(job.stdout + job.stderr)
        assert text.count(f"is being written by pid {proc.pid}") >= 2, text[-3000:]
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        proc.kill()
        proc.wait()
