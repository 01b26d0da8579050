"""Backfills (SidecarEvaluator.backfill, cadence.sidecar.backfill) with the sidecar tests' fake
evaluator, the real checkpoint manager, real leases and a fake trainer (no torch): the list and its
order, what is already recorded, checkpoints retention deletes meanwhile, the lease, the name held."""

from __future__ import annotations

import json
import os
import socket

import pytest

from cadence import Controller
from cadence.actions import BestCheckpointExporter
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.leases import Leases
from cadence.errors import NoCheckpointError, ReaderLeaseHeldError
from cadence.sidecar.backfill import Backfill, backfill_plan
from cadence.sidecar.evaluator import SidecarEvaluator
from fakes import FakeTrainer
from test_sidecar import FakeEvaluator, log_of, train

STEPS = [2, 4, 6, 8, 10, 12]


def sidecar(model_dir, ev=None, **kwargs) -> SidecarEvaluator:
    return SidecarEvaluator(ev or FakeEvaluator(), str(model_dir), poll_interval=0.01, **kwargs)


def test_a_list_is_evaluated_oldest_first_then_all_does_only_the_rest(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    first = sidecar(tmp_path, ev, name="late", best_metric="accuracy").backfill([8, 4, 8])
    assert ev.evaluated == [4, 8] and first.stop_reason == "backfilled" and first.evaluated == [4, 8]
    assert first.best == {"metric": "accuracy", "step": 8, "value": 0.7}
    rest = FakeEvaluator()
    second = sidecar(tmp_path, rest, name="late", best_metric="accuracy").backfill()
    assert rest.evaluated == [2, 6, 10, 12] and second.evaluated == [2, 6, 10, 12]
    assert second.best == {"metric": "accuracy", "step": 6, "value": 0.9}  # over the whole log
    rows = log_of(tmp_path, "eval_late")
    assert [r["step"] for r in rows] == [4, 8, 2, 6, 10, 12] and all(r["status"] == "evaluated" for r in rows)
    assert rows[0]["metrics"] == {"accuracy": 0.6, "loss": pytest.approx(0.4)}
    again = FakeEvaluator()
    third = sidecar(tmp_path, again, name="late").backfill()
    assert again.evaluated == [] and third.stop_reason == "backfilled" and "nothing to backfill" in third.message
    assert len(log_of(tmp_path, "eval_late")) == 6
    assert not (tmp_path / "eval").exists()  # only its name's log
    assert not list((tmp_path / "checkpoints" / ".leases").glob("*.json"))  # released


def test_backfill_and_sidecar_of_one_name_skip_each_others_records(tmp_path):
    train(tmp_path)
    sidecar(tmp_path, max_evaluations=2).start()  # the sidecar did 2 and 4, then stopped
    ev = FakeEvaluator()
    assert sidecar(tmp_path, ev).backfill([4, 6, 10]).evaluated == [6, 10]  # 4 has the sidecar's record
    assert ev.evaluated == [6, 10]
    # the sidecar resumes before the gaps the backfill left (8, 12), passing over what it recorded
    later = FakeEvaluator()
    result = sidecar(tmp_path, later).start()
    assert later.evaluated == [8, 12] and result.stop_reason == "final"
    steps = [r["step"] for r in log_of(tmp_path)]
    assert sorted(steps) == STEPS and len(steps) == len(set(steps))


def test_the_checkpoint_read_is_leased_and_retention_deletes_the_others_recorded_skipped(tmp_path):
    """While step 2 is evaluated the trainer trains on with max_to_keep=2: retention deletes 4, 6 and
    8 (no range protects them) but not 2 (``reading``): 2 is evaluated and copied to best/, the
    others are recorded skipped with the reason, none unrecorded."""
    train(tmp_path, 8)
    writer = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=2)
    trainer = Controller(trainer=FakeTrainer(), checkpoint_manager=writer, steps_per_loop=2, checkpoint_interval=2,
                         progress=False)
    trainer.restore()
    ev = FakeEvaluator()
    original = ev.evaluate
    leases_seen = []

    def evaluate_while_the_trainer_runs_on(n):
        leases_seen.append([(lease.after, lease.reading) for lease in Leases(str(tmp_path / "checkpoints")).active()])
        if ev.step == 2:
            trainer.train(12)
        return original(n)

    ev.evaluate = evaluate_while_the_trainer_runs_on
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    result = sidecar(tmp_path, ev, eval_actions=[exporter]).backfill()
    assert leases_seen == [[(None, 2)]]  # only the checkpoint read, no range
    assert ev.evaluated == [2] and result.evaluated == [2] and result.skipped == [4, 6, 8]
    rows = {r["step"]: r for r in log_of(tmp_path)}
    assert sorted(rows) == [2, 4, 6, 8]  # the list taken at the start: 10 and 12 came later
    assert all("deleted before it could be read" in rows[s]["error"] for s in (4, 6, 8))
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 2
    assert writer.steps() == [2, 10, 12]  # retention kept 2 while it was read


def test_stopped_between_checkpoints_then_run_again_does_only_what_is_left(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    evaluator = sidecar(tmp_path, ev)
    original = ev.evaluate

    def evaluate_then_stop(n):
        out = original(n)
        if len(ev.evaluated) == 3:
            evaluator.stop()  # as SIGTERM does
        return out

    ev.evaluate = evaluate_then_stop
    result = evaluator.backfill()
    assert result.stop_reason == "stopped" and "3 of 6 checkpoints left" in result.message
    rest = FakeEvaluator()
    assert sidecar(tmp_path, rest).backfill().evaluated == [8, 10, 12] == rest.evaluated
    assert [r["step"] for r in log_of(tmp_path)] == STEPS


def test_the_plan_refuses_a_step_neither_committed_nor_recorded(tmp_path):
    manager = train(tmp_path, 6)
    assert backfill_plan(manager, [], None) == ([2, 4, 6], [])
    assert backfill_plan(manager, [{"step": 4}, {"step": 8}], [8, 6, 4]) == ([6], [4, 8])  # 8: recorded, deleted since
    with pytest.raises(NoCheckpointError, match=r"no committed checkpoint at step 3, 5 in .*\(committed: 2, 4, 6\)"):
        backfill_plan(manager, [], [2, 3, 5])
    with pytest.raises(NoCheckpointError, match="no committed checkpoint in .*nothing to backfill"):
        backfill_plan(CheckpointManager(str(tmp_path / "none"), writer=False), [], None)
    with pytest.raises(NoCheckpointError):
        sidecar(tmp_path).backfill([3])
    controller = Controller(evaluator=FakeEvaluator(), checkpoint_manager=manager, restore=False, progress=False)
    with pytest.raises(ValueError, match="a backfill watches nothing: max_pending, timeout do not apply"):
        Backfill(controller, timeout=3, max_pending=2)
    assert not (tmp_path / "eval").exists() and not (tmp_path / "checkpoints" / ".leases").exists()  # nothing written


def _hold(tmp_path, holder: str, *, pid: int, host: str) -> None:
    """A lease of ``holder``, unexpired, as if process ``pid`` of ``host`` had written it."""
    leases = Leases(str(tmp_path / "checkpoints"))
    leases.write(holder, after=None, reading=None, ttl=60)
    path = tmp_path / "checkpoints" / ".leases" / f"{holder}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": pid, "host": host}))


@pytest.mark.parametrize("start", ["backfill", "sidecar"])
def test_a_name_another_live_process_evaluates_under_is_refused(tmp_path, start):
    train(tmp_path, 4)
    _hold(tmp_path, "sidecar-late", pid=1, host=socket.gethostname())  # init: alive, not us
    ev = FakeEvaluator()
    run = sidecar(tmp_path, ev, name="late")
    with pytest.raises(ReaderLeaseHeldError, match=r"another evaluator runs as 'sidecar-late' on .*: pid 1 on host"):
        run.backfill() if start == "backfill" else run.start()
    assert ev.evaluated == [] and not (tmp_path / "eval_late").exists()
    _hold(tmp_path, "sidecar-late", pid=1, host="another-host")  # another machine: held until it lapses
    with pytest.raises(ReaderLeaseHeldError, match="pid 1 on host another-host"):
        run.backfill() if start == "backfill" else run.start()
    assert sidecar(tmp_path, ev).backfill().evaluated == [2, 4]  # another name is free


def test_a_lease_left_by_a_dead_process_of_this_host_or_this_process_does_not_hold_the_name(tmp_path):
    train(tmp_path, 4)
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # no process has it
    _hold(tmp_path, "sidecar-eval", pid=dead, host=socket.gethostname())  # killed with kill -9
    assert sidecar(tmp_path).backfill([2]).evaluated == [2]
    _hold(tmp_path, "sidecar-eval", pid=os.getpid(), host=socket.gethostname())
    assert sidecar(tmp_path).start().evaluated == [4]
