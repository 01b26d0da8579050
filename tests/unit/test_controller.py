"""Controller rules, with a fake trainer/evaluator (no torch), the real checkpoint manager and
the real summary writer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cadence import Callback, CheckpointError, Controller, StopTraining
from cadence.checkpoint import CheckpointManager
from cadence.summaries.metrics_file import read_metrics
from fakes import MODEL_FILE, FakeTrainer


class FakeEvaluator:
    def __init__(self, trainer: FakeTrainer | None = None, metric=None) -> None:
        self.trainer = trainer
        self.calls: list[tuple[int, int]] = []
        self.metric = metric or (lambda step: float(step))
        self.loaded: list[float] = []

    def evaluate(self, num_steps: int):
        step = self.trainer.step if self.trainer else -1
        self.calls.append((step, num_steps))
        return {"accuracy": self.metric(step)}

    def load_checkpoint(self, reader, state):
        self.loaded.append(json.loads(reader.read(MODEL_FILE))["value"])


class Recorder:
    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def __call__(self, output):
        self.outputs.append(dict(output))


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"), **kw)


# ------------------------------------------------------------------ construction


def test_needs_trainer_or_evaluator():
    with pytest.raises(ValueError, match="trainer, an evaluator"):
        Controller()


def test_steps_per_loop_required_and_validated():
    with pytest.raises(ValueError, match="steps_per_loop is required"):
        Controller(trainer=FakeTrainer())
    with pytest.raises(ValueError, match="steps_per_loop"):
        Controller(trainer=FakeTrainer(), steps_per_loop=0)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        Controller(trainer=FakeTrainer(), steps_per_loop=2, checkpoint_interval=-3)


def test_summary_interval_must_be_multiple_of_steps_per_loop():
    with pytest.raises(ValueError, match=r"summary_interval \(15\).*steps_per_loop \(10\)"):
        Controller(trainer=FakeTrainer(), steps_per_loop=10, summary_interval=15)
    Controller(trainer=FakeTrainer(), steps_per_loop=10, summary_interval=30)


def test_restores_latest_checkpoint_on_construction(tmp_path):
    t1 = FakeTrainer()
    c1 = Controller(trainer=t1, checkpoint_manager=manager(tmp_path), steps_per_loop=4, progress=False)
    assert c1.restored_step is None and t1.initialized == 1
    c1.train(12)

    t2 = FakeTrainer()
    c2 = Controller(trainer=t2, checkpoint_manager=manager(tmp_path), steps_per_loop=4, progress=False)
    assert c2.restored_step == 12
    assert t2.global_step == 12 and t2.value == t1.value
    assert t2.initialized == 0  # initialize only on a fresh start


def test_restore_step_restores_that_checkpoint(tmp_path):
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path, max_to_keep=None),
                   steps_per_loop=2, checkpoint_interval=2, progress=False)
    c.train(6)
    ev = FakeEvaluator()
    c2 = Controller(evaluator=ev, checkpoint_manager=manager(tmp_path, writer=False), restore_step=4,
                    progress=False)
    assert c2.global_step == 4
    assert ev.loaded == [sum(range(1, 5))]


# ------------------------------------------------------------------ train


def test_train_runs_inner_loops_to_absolute_target():
    t = FakeTrainer()
    c = Controller(trainer=t, steps_per_loop=3, progress=False)
    c.train(10)
    assert t.requests == [3, 3, 3, 1]
    c.train(10)  # already reached: no-op
    assert t.requests == [3, 3, 3, 1]
    c.train(12)
    assert t.requests[-1] == 2 and t.global_step == 12


def test_train_none_runs_until_data_exhausted(tmp_path):
    t = FakeTrainer(data=7)
    m = manager(tmp_path)
    c = Controller(trainer=t, checkpoint_manager=m, steps_per_loop=3, progress=False)
    c.train(None)
    assert t.global_step == 7
    assert m.steps() == [7] and m.final_step() == 7


def test_train_none_stops_when_exhaustion_lands_on_loop_boundary():
    t = FakeTrainer(data=6)
    actions = Recorder()
    c = Controller(trainer=t, steps_per_loop=3, train_actions=[actions], progress=False)
    c.train(None)
    assert t.global_step == 6
    assert t.requests == [3, 3, 3]
    assert len(actions.outputs) == 2  # the empty loop runs no actions


def test_callable_steps_per_loop():
    t = FakeTrainer()
    c = Controller(trainer=t, steps_per_loop=lambda step: 1 if step < 3 else 5, progress=False)
    c.train(14)
    assert t.requests == [1, 1, 1, 5, 5, 1]


def test_callable_steps_per_loop_bad_value():
    c = Controller(trainer=FakeTrainer(), steps_per_loop=lambda step: 0, progress=False)
    with pytest.raises(ValueError, match=r"steps_per_loop\(0\) returned 0"):
        c.train(5)


def test_trainer_that_does_not_advance_as_requested_raises_with_both_numbers():
    t = FakeTrainer(data=5)
    c = Controller(trainer=t, steps_per_loop=4, progress=False)
    with pytest.raises(RuntimeError, match=r"advanced the global step by 1 .*but 4 steps were requested"):
        c.train(8)

    class Overshoot(FakeTrainer):
        def train(self, num_steps):
            return super().train(num_steps + 1)

    c = Controller(trainer=Overshoot(), steps_per_loop=4, progress=False)
    with pytest.raises(RuntimeError, match=r"by 5 .*but 4 steps"):
        c.train(8)


def test_train_actions_get_loop_output_with_steps_per_second():
    rec = Recorder()
    c = Controller(trainer=FakeTrainer(), steps_per_loop=5, train_actions=[rec], progress=False)
    c.train(10)
    assert len(rec.outputs) == 2
    assert all({"loss", "steps_per_second"} <= set(o) for o in rec.outputs)
    assert rec.outputs[1]["loss"] == pytest.approx(0.1)
    assert rec.outputs[0]["steps_per_second"] > 0


def test_summaries_written_when_due(tmp_path):
    c = Controller(trainer=FakeTrainer(), steps_per_loop=2, summary_interval=4,
                   summary_dir=str(tmp_path / "train"), progress=False)
    c.train(12)
    c.close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "train"))] == [4, 8, 12]
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))

    c = Controller(trainer=FakeTrainer(), steps_per_loop=3, summary_dir=str(tmp_path / "every"),
                   progress=False)
    c.train(9)
    c.close()
    rows = read_metrics(str(tmp_path / "every"))
    assert [r["step"] for r in rows] == [3, 6, 9]
    assert {"loss", "steps_per_second", "time"} <= set(rows[0])


def test_checkpoint_when_interval_crossed_and_always_at_completion(tmp_path):
    m = manager(tmp_path, max_to_keep=None)
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=m, steps_per_loop=3,
                   checkpoint_interval=5, progress=False)
    c.train(14)
    # loops end at 3, 6, 9, 12, 14: multiples of 5 crossed in (3,6] and (9,12]; 14 at completion
    assert m.steps() == [6, 12, 14]
    assert m.final_step() == 14


def test_no_interval_saves_only_at_completion(tmp_path):
    m = manager(tmp_path, max_to_keep=None)
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=m, steps_per_loop=3, progress=False)
    c.train(10)
    assert m.steps() == [10]


def test_checkpoint_at_completion_false(tmp_path):
    m = manager(tmp_path)
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=m, steps_per_loop=3, progress=False)
    c.train(9, checkpoint_at_completion=False)
    assert m.steps() == [] and m.final_step() is None


def test_training_further_removes_final(tmp_path):
    m = manager(tmp_path)
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=m, steps_per_loop=3, progress=False)
    c.train(6)
    assert m.final_step() == 6

    seen = []

    class Spy:
        def __call__(self, output):
            seen.append(m.final_step())

    c.train_actions.append(Spy())
    c.train(9)
    assert seen == [None]
    assert m.final_step() == 9


def test_stop_training_from_train_action_saves_and_returns(tmp_path):
    m = manager(tmp_path)

    def stop_at_6(output):
        if output["loss"] <= 1 / 6:
            raise StopTraining("loss low enough")

    t = FakeTrainer()
    c = Controller(trainer=t, checkpoint_manager=m, steps_per_loop=3, train_actions=[stop_at_6],
                   progress=False)
    c.train(30)
    assert t.global_step == 6
    assert c.stop_reason == "loss low enough"
    assert m.steps() == [6] and m.final_step() == 6


def test_other_action_errors_propagate_after_committing_the_trained_steps(tmp_path):
    m = manager(tmp_path)

    def boom(output):
        raise KeyError("nope")

    c = Controller(trainer=FakeTrainer(), checkpoint_manager=m, steps_per_loop=3,
                   train_actions=[boom], progress=False)
    with pytest.raises(KeyError):
        c.train(9)
    assert m.steps() == [3] and m.final_step() is None  # kept (tests/processes/test_sanity_check.py), not final


def test_stateful_actions_are_checkpointed(tmp_path):
    class Counter:
        def __init__(self):
            self.calls = 0

        def __call__(self, output):
            self.calls += 1

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    a = Counter()
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               train_actions=[a], progress=False).train(8)
    b = Counter()
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               train_actions=[b], progress=False)
    assert b.calls == a.calls == 4


# ------------------------------------------------------------------ evaluate


def test_evaluate_returns_metrics_runs_actions_and_writes_summary(tmp_path):
    t = FakeTrainer()
    ev = FakeEvaluator(t)
    rec = Recorder()
    c = Controller(trainer=t, evaluator=ev, steps_per_loop=5, summary_dir=str(tmp_path / "train"),
                   eval_summary_dir=str(tmp_path / "eval"), eval_actions=[rec], progress=False)
    c.train(10)
    out = c.evaluate()
    c.close()
    assert out == {"accuracy": 10.0}
    assert ev.calls == [(10, -1)]
    assert rec.outputs == [{"accuracy": 10.0}]
    rows = read_metrics(str(tmp_path / "eval"))
    assert [(r["step"], r["accuracy"]) for r in rows] == [(10, 10.0)]


def test_evaluate_of_n_steps_gives_steps_per_second_as_orbit_but_not_to_the_eval_actions(tmp_path):
    class Slow(FakeEvaluator):
        def evaluate(self, num_steps):
            time.sleep(0.05)
            return super().evaluate(num_steps)

    t = FakeTrainer()
    rec, ended = Recorder(), Recorder()

    class Ended(Callback):
        def on_eval_end(self, run, metrics, step):
            ended(metrics)

    c = Controller(trainer=t, evaluator=Slow(t), steps_per_loop=5, eval_summary_dir=str(tmp_path / "eval"),
                   eval_actions=[rec], callbacks=[Ended()], progress=False)
    c.train(10)
    start = time.perf_counter()
    out = c.evaluate(3)
    assert 0 < out["steps_per_second"] <= 3 / 0.05 and out["steps_per_second"] >= 3 / (time.perf_counter() - start)
    assert out["accuracy"] == 10.0 and set(out) == {"accuracy", "steps_per_second"}
    assert rec.outputs == [{"accuracy": 10.0}]  # Orbit adds it after the eval actions ran
    assert ended.outputs == [out]
    assert c.evaluate() == {"accuracy": 10.0}  # steps=-1: no rate (Orbit: "only log if steps has been specified")
    c.close()
    rows = read_metrics(str(tmp_path / "eval"))
    assert [r["steps_per_second"] for r in rows if "steps_per_second" in r] == [out["steps_per_second"]]


def test_evaluate_steps_validation():
    c = Controller(evaluator=FakeEvaluator(), progress=False)
    with pytest.raises(ValueError, match="steps must be -1"):
        c.evaluate(0)
    c.evaluate(3)
    assert c.evaluator.calls == [(-1, 3)]
    with pytest.raises(ValueError, match="needs a trainer"):
        c.train(3)


def test_eval_summary_dir_defaults_to_summary_dir(tmp_path):
    t = FakeTrainer()
    c = Controller(trainer=t, evaluator=FakeEvaluator(t), steps_per_loop=2,
                   summary_dir=str(tmp_path / "s"), progress=False)
    c.train(2)
    c.evaluate()
    c.close()
    assert [("accuracy" in r) for r in read_metrics(str(tmp_path / "s"))] == [False, True]


# ------------------------------------------------------------------ train_and_evaluate


def test_train_and_evaluate_without_interval_evaluates_once_at_end(tmp_path):
    t = FakeTrainer()
    ev = FakeEvaluator(t)
    m = manager(tmp_path)
    c = Controller(trainer=t, evaluator=ev, checkpoint_manager=m, steps_per_loop=4, progress=False)
    out = c.train_and_evaluate(train_steps=10, eval_steps=7)
    assert ev.calls == [(10, 7)]
    assert out["accuracy"] == 10.0 and set(out) == {"accuracy", "steps_per_second"}
    assert m.steps() == [10] and m.final_step() == 10


def test_train_and_evaluate_segments_at_absolute_multiples(tmp_path):
    t = FakeTrainer()
    ev = FakeEvaluator(t)
    c = Controller(trainer=t, evaluator=ev, checkpoint_manager=manager(tmp_path), steps_per_loop=4,
                   progress=False)
    out = c.train_and_evaluate(train_steps=25, eval_interval=10)
    assert [s for s, _ in ev.calls] == [10, 20, 25]
    assert out == {"accuracy": 25.0}
    assert t.requests == [4, 4, 2, 4, 4, 2, 4, 1]

    # a resumed run at a non-aligned step evaluates at the same absolute steps
    t2 = FakeTrainer()
    t2.step = 13
    ev2 = FakeEvaluator(t2)
    Controller(trainer=t2, evaluator=ev2, steps_per_loop=4, progress=False).train_and_evaluate(
        train_steps=25, eval_interval=10)
    assert [s for s, _ in ev2.calls] == [20, 25]


def test_eval_at_start_evaluates_step_0_once_for_the_summaries_and_callbacks_not_the_actions(tmp_path):
    class Heard(Callback):
        def __init__(self):
            self.steps = []

        def on_eval_end(self, run, metrics, step):
            self.steps.append(step)

    def run(train_steps):
        t = FakeTrainer()
        heard, action = Heard(), Recorder()
        c = Controller(trainer=t, evaluator=FakeEvaluator(t), checkpoint_manager=manager(tmp_path), steps_per_loop=4,
                       eval_summary_dir=str(tmp_path / "eval"), eval_actions=[action], callbacks=[heard], progress=False)
        with c:
            c.train_and_evaluate(train_steps=train_steps, eval_interval=4, eval_at_start=True)
        return t, heard, action

    t, heard, action = run(8)
    assert heard.steps == [0, 4, 8] and t.requests == [4, 4]  # step 0: before the first step
    assert [r["step"] for r in read_metrics(str(tmp_path / "eval"))] == [0, 4, 8]
    assert action.outputs == [{"accuracy": 4.0}, {"accuracy": 8.0}]  # the baseline is no action's
    t, heard, action = run(12)  # resumed at step 8: step 0 is not evaluated again
    assert heard.steps == [12] and [r["step"] for r in read_metrics(str(tmp_path / "eval"))] == [0, 4, 8, 12]


class CountingEvalAction:
    """A stateful eval action: counts evaluations (checkpointed)."""

    def __init__(self):
        self.count = 0

    def __call__(self, output):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_checkpoint_at_an_eval_step_holds_the_eval_actions_state(tmp_path):
    m = manager(tmp_path, max_to_keep=None)
    counter = CountingEvalAction()
    seen = []
    t = FakeTrainer()
    c = Controller(trainer=t, evaluator=FakeEvaluator(t), checkpoint_manager=m, steps_per_loop=5,
                   checkpoint_interval=10, eval_actions=[counter, lambda out: seen.append(m.steps())],
                   progress=False)
    c.train_and_evaluate(train_steps=20, eval_interval=10)
    assert seen == [[], [10]]  # evaluation first, then the checkpoint due at that step
    assert m.steps() == [10, 20] and m.final_step() == 20
    counts = {s: m.read_state(s)["state"]["eval_actions/0/CountingEvalAction"]["count"] for s in m.steps()}
    assert counts == {10: 1, 20: 2}
    assert m.read_state(20)["state"]["controller"] == {"last_eval_step": 20}


def test_resume_at_an_eval_step_whose_eval_never_ran_evaluates_first(tmp_path):
    m = manager(tmp_path, max_to_keep=None)

    class Preempt:
        def __init__(self, controller_ref):
            self.ref = controller_ref

        def __call__(self, output):
            if self.ref[0].global_step == 10:
                self.ref[0].save_checkpoint()  # as SaveCheckpointIfPreempted does
                raise KeyboardInterrupt

    ref = []
    t = FakeTrainer()
    ev = FakeEvaluator(t)
    c = Controller(trainer=t, evaluator=ev, checkpoint_manager=m, steps_per_loop=5, progress=False)
    ref.append(c)
    c.train_actions.append(Preempt(ref))
    with pytest.raises(KeyboardInterrupt):
        c.train_and_evaluate(train_steps=20, eval_interval=10)
    assert ev.calls == [] and m.steps() == [10]

    t2 = FakeTrainer()
    ev2 = FakeEvaluator(t2)
    Controller(trainer=t2, evaluator=ev2, checkpoint_manager=manager(tmp_path), steps_per_loop=5,
               progress=False).train_and_evaluate(train_steps=20, eval_interval=10)
    assert [s for s, _ in ev2.calls] == [10, 20]  # the same evaluations as an uninterrupted run


def test_attach_is_called_once_before_restore(tmp_path):
    events = []

    class Attaching:
        def attach(self, controller):
            events.append(("attach", controller.global_step))

        def __call__(self, output):
            events.append(("call", output["loss"]))

    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               progress=False).train(4)
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
                   train_actions=[Attaching()], progress=False)
    assert events == [("attach", 0)]
    c.train(6)
    assert events[1:] == [("call", 1 / 6)]


class RollbackTrainer(FakeTrainer):
    """FakeTrainer whose data position (``position``) moves on after a rollback."""

    def __init__(self):
        super().__init__()
        self.position = 0
        self.rollback_kwargs = None

    def train(self, num_steps):
        self.position += num_steps
        return super().train(num_steps)

    def save_checkpoint(self, writer):
        return {**super().save_checkpoint(writer), "position": self.position}

    def load_checkpoint(self, reader, state, *, restore_data=True, restore_rng=True):
        super().load_checkpoint(reader, state)
        self.rollback_kwargs = (restore_data, restore_rng)
        if restore_data:
            self.position = state["position"]


def test_rollback_restores_model_but_keeps_the_data_position(tmp_path):
    m = manager(tmp_path)
    t = RollbackTrainer()
    rolled = []

    def diverge_once(output):
        if t.global_step == 12 and not rolled:
            rolled.append(c.rollback())

    c = Controller(trainer=t, checkpoint_manager=m, steps_per_loop=4, checkpoint_interval=8,
                   train_actions=[diverge_once], progress=False)
    c.train(16)
    assert rolled == [8]
    assert t.rollback_kwargs == (False, False)
    # steps 9..12 were redone on new data: 16 steps of model state, 20 steps of data consumed
    assert t.global_step == 16 and t.position == 20
    assert m.steps()[-1] == 16


def test_rollback_without_checkpoint_is_a_clear_error(tmp_path):
    c = Controller(trainer=RollbackTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
                   progress=False)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        c.rollback()
    with pytest.raises(ValueError, match="needs a checkpoint_manager"):
        Controller(trainer=FakeTrainer(), steps_per_loop=2, progress=False).rollback()


def test_train_and_evaluate_until_exhausted():
    t = FakeTrainer(data=13)
    ev = FakeEvaluator(t)
    c = Controller(trainer=t, evaluator=ev, steps_per_loop=4, progress=False)
    out = c.train_and_evaluate(train_steps=None, eval_interval=5)
    assert [s for s, _ in ev.calls] == [5, 10, 13]
    assert out == {"accuracy": 13.0}


def test_train_and_evaluate_stop_from_eval_action(tmp_path):
    t = FakeTrainer()
    metric = {5: 0.5, 10: 0.9, 15: 0.4}

    def stop_when_worse(out):
        if out["accuracy"] < 0.5:
            raise StopTraining("accuracy fell")

    m = manager(tmp_path)
    c = Controller(trainer=t, evaluator=FakeEvaluator(t, metric=lambda s: metric.get(s, 0.0)),
                   checkpoint_manager=m, steps_per_loop=5, eval_actions=[stop_when_worse], progress=False)
    out = c.train_and_evaluate(train_steps=100, eval_interval=5)
    assert out == {"accuracy": 0.4}
    assert t.global_step == 15
    assert m.steps()[-1] == 15 and m.final_step() == 15


def test_train_and_evaluate_on_completed_run_evaluates_once(tmp_path):
    m = manager(tmp_path)
    t = FakeTrainer()
    eval_dir = str(tmp_path / "eval")
    Controller(trainer=t, evaluator=FakeEvaluator(t), checkpoint_manager=m, steps_per_loop=5, eval_summary_dir=eval_dir,
               progress=False).train_and_evaluate(train_steps=10)
    t2 = FakeTrainer()
    ev2 = FakeEvaluator(t2)
    out = Controller(trainer=t2, evaluator=ev2, checkpoint_manager=manager(tmp_path), steps_per_loop=5,
                     eval_summary_dir=eval_dir, progress=False).train_and_evaluate(train_steps=10)
    assert t2.requests == [] and ev2.calls == []  # step 10 was evaluated: not again
    assert out == {"accuracy": 10.0}  # as recorded then
    assert [r["step"] for r in read_metrics(eval_dir)] == [10]


def test_training_from_an_older_checkpoint_than_the_latest_is_refused(tmp_path):
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path, max_to_keep=None), steps_per_loop=5,
               checkpoint_interval=5, progress=False).train(15)
    with pytest.raises(ValueError, match=r"restore_step=5 .*checkpoints \[10, 15\] exist after it"):
        Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=5, restore_step=5,
                   progress=False)
    # the latest is fine, and evaluating an older one is fine
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=5, restore_step=15,
               progress=False)
    c = Controller(evaluator=FakeEvaluator(), checkpoint_manager=manager(tmp_path, writer=False), restore_step=5,
                   progress=False)
    assert c.global_step == 5


def test_throttle_and_start_delay_skip_evaluations_but_never_the_final(monkeypatch):
    import cadence.loop.controller as controller_module

    now = [0.0]
    monkeypatch.setattr(controller_module.time, "monotonic", lambda: now[0])

    class Clocked(FakeTrainer):
        def train(self, num_steps):
            now[0] += num_steps  # one "second" per step
            return super().train(num_steps)

    t = Clocked()
    ev = FakeEvaluator(t)
    Controller(trainer=t, evaluator=ev, steps_per_loop=5, progress=False).train_and_evaluate(
        train_steps=40, eval_interval=5, throttle_secs=12)
    # due at 5, 10, ...: at most one per 12 "seconds", and always the last one
    assert [s for s, _ in ev.calls] == [5, 20, 35, 40]

    now[0] = 0.0
    t2 = Clocked()
    ev2 = FakeEvaluator(t2)
    Controller(trainer=t2, evaluator=ev2, steps_per_loop=5, progress=False).train_and_evaluate(
        train_steps=30, eval_interval=5, start_delay_secs=18)
    assert [s for s, _ in ev2.calls] == [20, 25, 30]
    with pytest.raises(ValueError, match="throttle_secs"):
        Controller(trainer=FakeTrainer(), evaluator=FakeEvaluator(), steps_per_loop=5,
                   progress=False).train_and_evaluate(10, throttle_secs=-1)


def test_nested_evaluation_outputs_get_a_summary_subdirectory_each(tmp_path):
    """Orbit's test_evaluate_with_nested_summaries: one subdirectory per top-level key."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class TwoDatasets:
        def evaluate(self, num_steps):
            return {"dataset": {"loss": 0.5, "accuracy": 0.9}, "dataset2": {"loss": 0.7, "accuracy": 0.8}}

    Controller(evaluator=TwoDatasets(), eval_summary_dir=str(tmp_path), progress=False).evaluate(steps=5)
    for name in ("dataset", "dataset2"):
        acc = EventAccumulator(str(tmp_path / name))
        acc.Reload()
        assert sorted(acc.Tags()["scalars"]) == ["accuracy", "loss"]
