"""The hang watchdog (cadence.runtime.watchdog): quiet while the run beats, fires once when it stops, and
reports the phase, the step and where the watched thread is stuck."""

from __future__ import annotations

import threading
import time

import pytest

from cadence.loop.controller import Controller
from cadence.runtime.watchdog import HANG_EXIT_CODE, Heartbeat, Watchdog, unwatched
from fakes import FakeTrainer


def stuck_in_a_collective(release: threading.Event) -> None:
    release.wait(10)


def test_a_beating_run_is_never_reported_and_a_stuck_one_is_reported_once():
    heartbeat, reports = Heartbeat(), []
    with Watchdog(heartbeat, 0.3, rank=1, on_hang=reports.append, poll=0.02):
        for _ in range(40):  # 0.6 s of progress, twice the timeout
            heartbeat.beat()
            time.sleep(0.015)
        assert reports == []
        heartbeat.enter("train", 120)
        time.sleep(0.6)  # no beat for twice the timeout
    assert len(reports) == 1
    assert reports[0].startswith("rank 1: no progress for ")
    assert "in phase 'train' at step 120" in reports[0]
    assert f"(exit {HANG_EXIT_CODE})" in reports[0]


def test_the_report_shows_the_stack_of_the_watched_thread():
    heartbeat, reports, release = Heartbeat(), [], threading.Event()
    worker = threading.Thread(target=stuck_in_a_collective, args=(release,), name="trainer")
    worker.start()
    try:
        with Watchdog(heartbeat, 0.1, on_hang=reports.append, poll=0.02, thread=worker):
            time.sleep(0.4)
    finally:
        release.set()
        worker.join()
    assert len(reports) == 1
    assert "trainer is at:" in reports[0] and "in stuck_in_a_collective" in reports[0]
    assert "release.wait(10)" in reports[0]


def test_a_stopped_watchdog_never_fires():
    reports: list[str] = []
    watchdog = Watchdog(Heartbeat(), 0.1, on_hang=reports.append, poll=0.02).start()
    watchdog.stop()
    time.sleep(0.3)
    assert reports == []


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_a_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Watchdog(Heartbeat(), timeout)


def test_the_controller_marks_its_phases_on_the_heartbeat():
    heartbeat, phases = Heartbeat(), []

    class Recording(FakeTrainer):
        def train(self, num_steps):
            phases.append((heartbeat.phase, heartbeat.step))
            return super().train(num_steps)

    controller = Controller(trainer=Recording(), steps_per_loop=5, heartbeat=heartbeat)
    assert heartbeat.phase == "restore"
    controller.train(10)
    assert phases == [("train", 0), ("train", 5)]
    assert heartbeat.phase == "actions" and heartbeat.step == 10
    assert heartbeat.beats >= 5  # restore, and per loop: train and actions


def test_the_report_names_the_step_being_run_not_the_loop_start():
    heartbeat, reports = Heartbeat(), []
    heartbeat.enter("train", 100)
    for _ in range(7):  # the trainer's beats: one per step
        heartbeat.beats += 1
    with Watchdog(heartbeat, 0.1, on_hang=reports.append, poll=0.02):
        time.sleep(0.3)
    assert "in phase 'train' at step 107;" in reports[0]
    heartbeat.enter("evaluate", 107)
    heartbeat.beats += 3  # the evaluator's: one per batch
    assert heartbeat.position() == "at step 107, after 3 evaluation batches"
    heartbeat.enter("checkpoint", 107)
    assert heartbeat.position() == "at step 107"


def test_building_the_inputs_is_not_timed():
    """A Task building its inputs on first use (a download) is slow, not stuck."""
    heartbeat, reports = Heartbeat(), []
    with Watchdog(heartbeat, 0.1, on_hang=reports.append, poll=0.02):
        with unwatched(heartbeat):
            time.sleep(0.4)
        assert reports == [] and heartbeat.paused == 0 and heartbeat.beats == 0
        time.sleep(0.3)  # stuck afterwards: timed again
    assert len(reports) == 1
    with unwatched(None):  # no watchdog
        pass
