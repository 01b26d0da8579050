"""SidecarEvaluator and Controller.evaluate_continuously with fake runners, the real checkpoint
manager, real leases and real threads (no torch)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cadence import Controller
from cadence.actions import BestCheckpointExporter
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.leases import Leases
from cadence.checkpoint.watcher import CheckpointWatcher
from cadence.sidecar.evaluator import EVALUATIONS_FILE, SidecarEvaluator
from cadence.summaries.metrics_file import read_metrics
from fakes import MODEL_FILE, FakeTrainer

ACCURACY = {2: 0.3, 4: 0.6, 6: 0.9, 8: 0.7, 10: 0.9, 12: 0.8}


class FakeEvaluator:
    """Loads the step from the checkpoint's model file; ``accuracy`` per step; optional delay."""

    def __init__(self, delay: float = 0.0, accuracy=None) -> None:
        self.step: int | None = None
        self.delay = delay
        self.accuracy = accuracy or ACCURACY
        self.evaluated: list[int] = []

    def load_checkpoint(self, reader, state):
        self.step = json.loads(reader.read(MODEL_FILE))["step"]

    def evaluate(self, num_steps: int):
        time.sleep(self.delay)
        self.evaluated.append(self.step)
        return {"accuracy": self.accuracy[self.step], "loss": 1 - self.accuracy[self.step]}


def train(model_dir: Path, steps: int = 12, *, every: int = 2, max_to_keep=None, trainer=None) -> CheckpointManager:
    manager = CheckpointManager(str(model_dir / "checkpoints"), max_to_keep=max_to_keep)
    Controller(trainer=trainer or FakeTrainer(), checkpoint_manager=manager, steps_per_loop=every,
               checkpoint_interval=every, progress=False).train(steps)
    return manager


def log_of(model_dir: Path, name: str = "eval") -> list[dict]:
    return read_metrics(model_dir / name / EVALUATIONS_FILE)


def test_every_mode_evaluates_each_checkpoint_of_a_finished_run_once_in_order(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), mode="every", poll_interval=0.01, best_metric="accuracy").start()
    assert ev.evaluated == [2, 4, 6, 8, 10, 12]
    assert result.stop_reason == "final" and "final checkpoint (step 12)" in result.message
    rows = log_of(tmp_path)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in (2, 4, 6, 8, 10, 12)]
    assert rows[2]["metrics"]["accuracy"] == 0.9 and rows[2]["checkpoint"].endswith("ckpt-6")
    assert result.best == {"metric": "accuracy", "step": 6, "value": 0.9}  # strict: 10 ties, 6 stays
    # TensorBoard + metrics.jsonl at each checkpoint's step
    assert [r["step"] for r in read_metrics(tmp_path / "eval")] == [2, 4, 6, 8, 10, 12]
    assert list((tmp_path / "eval").glob("events.out.tfevents.*"))
    # the lease is released on exit
    assert not list((tmp_path / "checkpoints" / ".leases").glob("*.json"))


def test_latest_mode_evaluates_the_newest(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), mode="latest", poll_interval=0.01).start()
    assert ev.evaluated == [12] and result.stop_reason == "final"


def test_named_sidecar_writes_its_own_dir(tmp_path):
    train(tmp_path, steps=4)
    SidecarEvaluator(FakeEvaluator(), str(tmp_path), name="holdout", poll_interval=0.01).start()
    assert [r["step"] for r in log_of(tmp_path, "eval_holdout")] == [2, 4]
    assert not (tmp_path / "eval").exists()


def test_restart_never_evaluates_a_step_twice_and_rebuilds_the_best(tmp_path):
    train(tmp_path)
    first = FakeEvaluator()
    r1 = SidecarEvaluator(first, str(tmp_path), max_evaluations=3, poll_interval=0.01,
                          best_metric="accuracy").start()
    assert r1.stop_reason == "max_evaluations" and first.evaluated == [2, 4, 6]
    second = FakeEvaluator()
    r2 = SidecarEvaluator(second, str(tmp_path), poll_interval=0.01, best_metric="accuracy").start()
    assert second.evaluated == [8, 10, 12]
    assert r2.best == {"metric": "accuracy", "step": 6, "value": 0.9}  # rebuilt from evaluations.jsonl
    steps = [r["step"] for r in log_of(tmp_path)]
    assert steps == sorted(set(steps)) == [2, 4, 6, 8, 10, 12]
    # a third start has nothing to do
    third = FakeEvaluator()
    assert SidecarEvaluator(third, str(tmp_path), poll_interval=0.01).start().stop_reason == "final"
    assert third.evaluated == []


def test_max_evaluations_counts_across_restarts(tmp_path):
    train(tmp_path)
    SidecarEvaluator(FakeEvaluator(), str(tmp_path), max_evaluations=2, poll_interval=0.01).start()
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), max_evaluations=2, poll_interval=0.01).start()
    assert ev.evaluated == [] and result.stop_reason == "max_evaluations"


def test_dead_trainer_times_out_with_a_message(tmp_path, caplog):
    trainer = FakeTrainer()
    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    c = Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
                   progress=False)
    c.train(4, checkpoint_at_completion=False)  # "killed": checkpoints, no FINAL
    ev = FakeEvaluator()
    with caplog.at_level("INFO", logger="cadence.sidecar.evaluator"):
        result = SidecarEvaluator(ev, str(tmp_path), timeout=0.3, poll_interval=0.02).start()
    assert ev.evaluated == [2, 4]
    assert result.stop_reason == "timeout"
    assert "no new checkpoint" in result.message and "no FINAL" in result.message
    assert result.message in caplog.text


def test_train_steps_is_final_without_FINAL(tmp_path):
    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
               progress=False).train(6, checkpoint_at_completion=False)
    result = SidecarEvaluator(FakeEvaluator(), str(tmp_path), train_steps=6, poll_interval=0.01).start()
    assert result.stop_reason == "final"


def test_corrupt_checkpoint_is_recorded_failed_and_skipped(tmp_path, caplog):
    train(tmp_path, steps=6)
    model = tmp_path / "checkpoints" / "ckpt-4" / MODEL_FILE
    model.write_bytes(model.read_bytes().replace(b"4", b"5"))  # same size, other bytes
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01, max_retries=2, retry_backoff=0.01).start()
    assert ev.evaluated == [2, 6]
    assert result.failed == [4]
    rows = {r["step"]: r for r in log_of(tmp_path)}
    assert rows[4]["status"] == "failed" and "crc32c" in rows[4]["error"]
    assert caplog.text.count("retrying") == 2


def test_checkpoints_committed_while_waiting_are_evaluated(tmp_path):
    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    trainer = FakeTrainer()
    controller = Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
                            progress=False)

    def slow_training():
        for target in (2, 4, 6):
            time.sleep(0.1)
            controller.train(target, checkpoint_at_completion=(target == 6))

    thread = threading.Thread(target=slow_training)
    thread.start()
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01, timeout=30).start()
    thread.join()
    assert ev.evaluated == [2, 4, 6] and result.stop_reason == "final"


def test_leases_keep_pending_checkpoints_from_retention(tmp_path):
    """A slow sidecar: the trainer (max_to_keep=1) cannot delete what the sidecar has yet to read."""
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=1)
    trainer = FakeTrainer()
    controller = Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
                            progress=False)
    controller.train(2, checkpoint_at_completion=False)
    ev = FakeEvaluator(delay=0.15)
    sidecar = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01, timeout=30, max_pending=None)
    thread = threading.Thread(target=lambda: setattr(sidecar, "result", sidecar.start()))
    thread.start()
    deadline = time.monotonic() + 30
    while not Leases(str(tmp_path / "checkpoints")).active():  # training on before the lease would race it
        assert time.monotonic() < deadline, "the sidecar took no lease"
        time.sleep(0.01)
    for target in (4, 6, 8, 10, 12):
        time.sleep(0.03)
        controller.train(target, checkpoint_at_completion=(target == 12))
    thread.join()
    assert ev.evaluated == [2, 4, 6, 8, 10, 12]
    assert all(r["status"] == "evaluated" for r in log_of(tmp_path))  # none deleted from under it


def test_max_pending_releases_the_oldest_and_records_them_skipped(tmp_path):
    train(tmp_path)  # six checkpoints waiting
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), max_pending=2, poll_interval=0.01).start()
    assert ev.evaluated == [10, 12]
    assert result.skipped == [2, 4, 6, 8]
    rows = log_of(tmp_path)
    assert [(r["step"], r["status"]) for r in rows][:4] == [(s, "skipped") for s in (2, 4, 6, 8)]
    assert "max_pending=2" in rows[0]["error"]


def test_checkpoints_deleted_before_the_sidecar_saw_them_are_recorded_skipped(tmp_path):
    """A trainer much faster than the sidecar's looks: between two of them it commits more than
    max_pending checkpoints and retention (max_to_keep=1) deletes the oldest out of the lease's
    bounded range. The writer notes what it deletes (``.leases/deleted-steps``) and the sidecar
    records each one it never saw as skipped: every checkpoint is evaluated or recorded."""
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=1)
    controller = Controller(trainer=FakeTrainer(), checkpoint_manager=manager, steps_per_loop=2,
                            checkpoint_interval=2, progress=False)
    ev = FakeEvaluator()
    # poll_interval: the six commits below fit within one poll on a loaded machine too (1 s did not, once)
    sidecar = SidecarEvaluator(ev, str(tmp_path), max_pending=2, poll_interval=3.0, timeout=30)
    thread = threading.Thread(target=lambda: setattr(sidecar, "result", sidecar.start()))
    thread.start()
    deadline = time.monotonic() + 30
    while not Leases(str(tmp_path / "checkpoints")).active():
        assert time.monotonic() < deadline, "the sidecar took no lease"
        time.sleep(0.01)
    controller.train(12)  # six checkpoints within one of the sidecar's polls
    thread.join()
    rows = {r["step"]: r for r in log_of(tmp_path)}
    assert sorted(rows) == [2, 4, 6, 8, 10, 12]
    assert ev.evaluated == [s for s in (10, 12) if rows[s]["status"] == "evaluated"] and 12 in ev.evaluated
    unseen = [s for s, r in rows.items() if r["status"] == "skipped" and "before it was seen" in r["error"]]
    assert unseen and set(unseen) <= {2, 4, 6, 8} and "max_pending=2" in rows[unseen[0]]["error"]
    assert sidecar.result.skipped == sorted(s for s, r in rows.items() if r["status"] == "skipped")
    assert set(unseen) <= set(Leases(str(tmp_path / "checkpoints")).deleted())  # the writer's note


def test_a_seen_checkpoint_retention_deleted_while_another_was_evaluated_is_skipped_naming_the_bound(tmp_path):
    """Checkpoints 2 and 4 wait (max_pending=2); while the sidecar evaluates 2 the trainer commits 6,
    8 and 10, so 4 leaves the lease's bounded range and retention deletes it: its record says why."""
    manager = train(tmp_path, 4, max_to_keep=2)
    controller = Controller(trainer=FakeTrainer(), checkpoint_manager=manager, steps_per_loop=2,
                            checkpoint_interval=2, progress=False)
    controller.restore()
    ev = FakeEvaluator()
    original = ev.evaluate

    def evaluate_while_the_trainer_runs_on(n):
        if ev.step == 2:
            controller.train(10)
        return original(n)

    ev.evaluate = evaluate_while_the_trainer_runs_on
    result = SidecarEvaluator(ev, str(tmp_path), max_pending=2, poll_interval=0.01).start()
    rows = {r["step"]: r for r in log_of(tmp_path)}
    assert ev.evaluated == [2, 8, 10] and result.skipped == [4, 6]
    assert "before it could be evaluated" in rows[4]["error"] and "max_pending=2" in rows[4]["error"]
    assert "before it was seen" in rows[6]["error"]


def test_a_sidecar_started_late_records_what_retention_deleted_before_it_as_skipped(tmp_path):
    train(tmp_path, max_to_keep=2)  # 2..12: 2, 4, 6 and 8 deleted before any sidecar
    ev = FakeEvaluator()
    result = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01).start()
    assert ev.evaluated == [10, 12] and result.skipped == [2, 4, 6, 8]
    rows = log_of(tmp_path)
    assert [(r["step"], r["status"]) for r in rows] == [(2, "skipped"), (4, "skipped"), (6, "skipped"),
                                                        (8, "skipped"), (10, "evaluated"), (12, "evaluated")]
    assert "deleted before this evaluator started" in rows[0]["error"]
    again = SidecarEvaluator(FakeEvaluator(), str(tmp_path), poll_interval=0.01).start()  # nothing twice
    assert again.skipped == [] and len(log_of(tmp_path)) == 6


def test_best_checkpoint_export_from_the_sidecar(tmp_path):
    train(tmp_path)
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    SidecarEvaluator(FakeEvaluator(), str(tmp_path), eval_actions=[exporter], poll_interval=0.01).start()
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] == 6 and best["value"] == 0.9
    copied = tmp_path / "best" / "ckpt-6" / MODEL_FILE
    assert copied.read_bytes() == (tmp_path / "checkpoints" / "ckpt-6" / MODEL_FILE).read_bytes()


def test_sidecar_stop_finishes_the_current_evaluation(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator(delay=0.05)
    sidecar = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01)
    original = ev.evaluate

    def evaluate_then_stop(n):
        out = original(n)
        sidecar.stop()
        return out

    ev.evaluate = evaluate_then_stop
    result = sidecar.start()
    assert result.stop_reason == "stopped" and ev.evaluated == [2]
    assert [r["step"] for r in log_of(tmp_path)] == [2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        SidecarEvaluator(FakeEvaluator(), "/tmp/x", mode="all")
    with pytest.raises(ValueError, match="max_pending"):
        SidecarEvaluator(FakeEvaluator(), "/tmp/x", max_pending=0)


# ------------------------------------------------------------------ Controller.evaluate_continuously


def test_evaluate_continuously_latest_and_final(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    c = Controller(evaluator=ev, checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints"), writer=False),
                   restore=False, progress=False)
    out = c.evaluate_continuously(poll_interval=0.01, mode="latest")  # Orbit's behaviour, by choice
    assert ev.evaluated == [12] and out == {"accuracy": 0.8, "loss": pytest.approx(0.2)}


def test_evaluate_continuously_defaults_to_every_checkpoint_as_the_sidecar(tmp_path):
    train(tmp_path)
    ev = FakeEvaluator()
    c = Controller(evaluator=ev, checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints"), writer=False),
                   restore=False, progress=False)
    out = c.evaluate_continuously()  # the sidecar's defaults: mode "every", poll 0.5 s; stops after FINAL
    assert ev.evaluated == [2, 4, 6, 8, 10, 12] and out == {"accuracy": 0.8, "loss": pytest.approx(0.2)}
    assert not (tmp_path / "eval").exists()  # no evaluations.jsonl, no lease: only the sidecar has them
    assert not list((tmp_path / "checkpoints" / ".leases").glob("*.json"))


def test_evaluate_continuously_timeout_fn_decides(tmp_path):
    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
               progress=False).train(4, checkpoint_at_completion=False)
    calls = []

    def timeout_fn():
        calls.append(1)
        return len(calls) >= 3  # keep waiting twice, then stop

    ev = FakeEvaluator()
    c = Controller(evaluator=ev, checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints"), writer=False),
                   restore=False, progress=False)
    c.evaluate_continuously(timeout=0.05, timeout_fn=timeout_fn, mode="every", poll_interval=0.01)
    assert ev.evaluated == [2, 4] and len(calls) == 3


def test_watcher_every_latest_and_should_stop(tmp_path):
    manager = train(tmp_path, steps=6)
    assert list(CheckpointWatcher(manager, mode="every", poll_interval=0.01)) == [2, 4, 6]
    assert list(CheckpointWatcher(manager, mode="latest", poll_interval=0.01)) == [6]
    assert list(CheckpointWatcher(manager, mode="every", after=4, poll_interval=0.01)) == [6]
    w = CheckpointWatcher(manager, mode="every", after=6, poll_interval=0.01, should_stop=lambda: True)
    assert list(w) == [] and w.stop_reason == "stopped"


def test_a_checkpoint_retention_deletes_while_it_is_evaluated_is_skipped_and_best_keeps_a_live_one(tmp_path):
    """CI repro: the sidecar loaded step 6 (the best), then retention deleted it before best/ could
    copy it. The sidecar goes on; step 6 is recorded skipped with the reason, and best/ holds the best
    of the checkpoints it could copy."""
    manager = train(tmp_path)
    ev = FakeEvaluator()
    original = ev.evaluate

    def evaluate_while_retention_deletes_it(n):
        if ev.step == 6:
            manager.delete(6)
        return original(n)

    ev.evaluate = evaluate_while_retention_deletes_it
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    result = SidecarEvaluator(ev, str(tmp_path), eval_actions=[exporter], poll_interval=0.01).start()
    rows = {r["step"]: r for r in log_of(tmp_path)}
    assert result.stop_reason == "final" and result.skipped == [6]
    assert rows[6]["status"] == "skipped" and "while it was evaluated" in rows[6]["error"]
    assert [s for s, r in sorted(rows.items()) if r["status"] == "evaluated"] == [2, 4, 8, 10, 12]
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert (best["step"], best["value"]) == (10, 0.9)
