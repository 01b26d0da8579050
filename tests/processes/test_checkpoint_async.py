"""Asynchronous checkpoint saves (``CheckpointManager(async_save=True)``): snapshot now, commit
in the background with the same protocol, one save in flight, failures surfaced, exit waits."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cadence import CheckpointError, CheckpointManager, Controller
from fakes import MODEL_FILE, FakeTrainer


class Gate:
    """Holds every background commit until opened; records the order of commits."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        self.order: list[int] = []
        real = manager._save_now

        def gated(step, objects):
            self.started.set()
            self.open.wait(10)
            self.order.append(step)
            return real(step, objects)

        manager._save_now = gated


class Value:
    def __init__(self) -> None:
        self.value = 1

    def save_checkpoint(self, writer):
        writer.write("value.json", json.dumps(self.value).encode())
        return {"value": self.value}


def test_save_returns_before_the_commit_with_a_snapshot_of_that_moment(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ckpts"), async_save=True)
    gate = Gate(manager)
    obj = Value()
    manager.save(1, {"v": obj})
    gate.started.wait(5)
    assert manager.steps() == []  # not committed yet: invisible
    obj.value = 99  # training goes on and changes the state
    gate.open.set()
    manager.wait()
    assert manager.steps() == [1]
    reader, state = manager.read(1)
    assert json.loads(reader.read("value.json")) == 1 and state["state"]["v"] == {"value": 1}


def test_at_most_one_save_in_flight(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ckpts"), async_save=True)
    gate = Gate(manager)
    manager.save(1, {"v": Value()})
    second_returned = threading.Event()
    thread = threading.Thread(target=lambda: (manager.save(2, {"v": Value()}), second_returned.set()))
    thread.start()
    assert not second_returned.wait(0.3)  # blocked behind the first
    gate.open.set()
    thread.join(10)
    manager.wait()
    assert gate.order == [1, 2] and manager.steps() == [1, 2]


def test_a_failed_background_save_surfaces_at_the_next_call_and_leaves_nothing(tmp_path):
    class BadName:
        def save_checkpoint(self, writer):
            writer.write("../escape", b"x")  # rejected by the writer, in the background
            return None

    manager = CheckpointManager(str(tmp_path / "ckpts"), async_save=True)
    manager.save(1, {"bad": BadName()})
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed"):
        manager.save(2, {"v": Value()})
    assert manager.steps() == []
    assert not [p for p in (tmp_path / "ckpts").iterdir() if p.name.startswith("ckpt-1")]


def test_controller_raises_an_async_failure_at_the_next_loop(tmp_path):
    class FailingOnce(FakeTrainer):
        fail = True

        def save_checkpoint(self, writer):
            if self.fail:
                self.fail = False
                writer.write("a/b", b"")  # an invalid name: the background commit fails
            return super().save_checkpoint(writer)

    manager = CheckpointManager(str(tmp_path / "ckpts"), async_save=True)
    c = Controller(trainer=FailingOnce(), checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
                   progress=False)
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed"):
        c.train(10)


def test_controller_with_async_saves_commits_everything_and_final(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ckpts"), async_save=True, max_to_keep=None)
    trainer = FakeTrainer()
    with Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=4,
                    progress=False) as c:
        c.train(12)
    assert manager.steps() == [4, 8, 12] and manager.final_step() == 12
    reader, _ = manager.read(8)
    assert json.loads(reader.read(MODEL_FILE))["step"] == 8


def test_process_exit_waits_for_the_pending_commit(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from cadence import CheckpointManager
class Slow:
    def save_checkpoint(self, writer):
        writer.write("big.bin", b"x" * 20_000_000)  # > 8 MiB: hashed on the helper thread during exit
        return None
m = CheckpointManager({str(tmp_path / "ckpts")!r}, async_save=True)
real = m._save_now
m._save_now = lambda step, objects: (time.sleep(0.5), real(step, objects))[1]
m.save(7, {{"s": Slow()}})
sys.exit(0)  # no wait(): the interpreter joins the non-daemon commit thread
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert CheckpointManager(str(tmp_path / "ckpts"), writer=False).steps() == [7]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_background_commit_runs_at_a_lower_cpu_priority(tmp_path):
    """Under CPU contention the training thread goes first: the commit thread is niced."""
    import os
    import threading

    from cadence.checkpoint import CheckpointManager
    from cadence.checkpoint.background import BACKGROUND_NICE

    seen: dict[str, int] = {}

    class Probe:
        def save_checkpoint(self, writer):
            tid = threading.get_native_id()
            seen["commit"] = os.getpriority(os.PRIO_PROCESS, tid)
            writer.write("x.bin", b"x")
            return None

        def snapshot_checkpoint(self):
            return self

    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    manager = CheckpointManager(str(tmp_path), async_save=True)
    manager.save(1, {"p": Probe()})
    manager.wait()
    assert seen["commit"] == min(19, here + BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here  # the caller is untouched
