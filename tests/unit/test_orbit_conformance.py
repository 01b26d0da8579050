"""Orbit's own tests (orbit/controller_test.py, orbit/actions/*_test.py) ported to cadence: the
contract Orbit users rely on, with a fake trainer and evaluator (no torch), real checkpoints in
``tmp_path`` and real TensorBoard event files read back.

Each test's docstring names the Orbit test it ports. TF specifics are translated: the global step
is the trainer's ``global_step``; Orbit's ``tf.train.CheckpointManager(checkpoint_interval=...)``
is ``Controller(checkpoint_interval=...)`` with a ``cadence.checkpoint.CheckpointManager``;
``restore_checkpoint()`` is ``Controller.restore()`` (a step, not a path). Where cadence differs
on purpose (docs/guide/coming-from.md, "Orbit and the TF Model Garden trainer"), the test asserts cadence's documented
behaviour and its docstring says "differs from Orbit: ...".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from cadence import Controller, StopTraining
from cadence.actions import ConditionalAction, ExportFileManager, JSONPersistedValue, NewBestMetric
from cadence.actions.persisted import PersistedValueError
from cadence.checkpoint import CheckpointManager
from fakes import MODEL_FILE, FakeTrainer

# ------------------------------------------------------------------ fakes and helpers


class Evaluator:
    """Orbit's TestRunner as an evaluator: ``eval_loss`` of the model state it evaluates, which
    is the trainer's step (sharing a trainer) or the step of the checkpoint it last loaded."""

    def __init__(self, trainer: FakeTrainer | None = None, convert=float) -> None:
        self.trainer = trainer
        self.convert = convert
        self.loaded: list[int] = []
        self.calls: list[tuple[int, int]] = []  # (step evaluated, num_steps)

    def step(self) -> int:
        if self.trainer is not None:
            return self.trainer.step
        return self.loaded[-1] if self.loaded else 0

    def evaluate(self, num_steps: int):
        self.calls.append((self.step(), num_steps))
        return {"eval_loss": self.convert(1.0 / (1 + self.step()))}

    def load_checkpoint(self, reader, state) -> None:
        self.loaded.append(json.loads(reader.read(MODEL_FILE))["step"])


class ConvertingTrainer(FakeTrainer):
    """FakeTrainer whose ``loss`` is converted (Orbit's return_numpy / return_tensor)."""

    def __init__(self, convert) -> None:
        super().__init__()
        self.convert = convert

    def train(self, num_steps: int):
        logs = super().train(num_steps)
        return {"loss": self.convert(logs["loss"])}


def summaries(logdir: Path) -> list[tuple[str, int, float]]:
    """Every scalar summary value in the event files of ``logdir`` (not its subdirectories), as
    ``(tag, step, value)``, file by file. Read raw, as Orbit's ``summaries_with_matching_keyword``
    does, so that every event counts (no de-duplication or purge of out-of-order steps)."""
    found = []
    for path in sorted(Path(logdir).glob("events.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                found.extend((v.tag, event.step, v.simple_value) for v in event.summary.value)
    return found


def steps_of(logdir: Path, tag: str) -> list[int]:
    """The steps at which ``tag`` was written in ``logdir``, in the order written."""
    return [step for t, step, _ in summaries(logdir) if t == tag]


def tags(logdir: Path) -> set[str]:
    return {t for t, _, _ in summaries(logdir)}


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=None, **kw)


def both(trainer: FakeTrainer, **kw) -> Controller:
    """Orbit's ``Controller(trainer=test_runner, evaluator=test_runner, steps_per_loop=2, ...)``."""
    return Controller(trainer=trainer, evaluator=Evaluator(trainer), steps_per_loop=2, progress=False, **kw)


# ------------------------------------------------------------------ controller_test.py


def test_no_checkpoint(tmp_path: Path) -> None:
    """test_no_checkpoint: no checkpoint manager, train and eval summaries in their own dirs; with
    no checkpoint, a trainer reset to step 0 trains to 10 again."""
    trainer = FakeTrainer()
    c = both(trainer, summary_dir=str(tmp_path / "summaries/train"),
             eval_summary_dir=str(tmp_path / "summaries/eval"))
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10
    assert steps_of(tmp_path / "summaries/train", "loss") == [2, 4, 6, 8, 10]
    assert steps_of(tmp_path / "summaries/eval", "eval_loss") == [6, 10]
    assert c.evaluator.calls == [(6, 2), (10, 2)]

    trainer.step = 0  # Orbit: test_runner.global_step.assign(0)
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10
    assert c.evaluator.calls == [(6, 2), (10, 2), (6, 2), (10, 2)]
    assert not (tmp_path / "checkpoints").exists()


def test_no_checkpoint_and_summaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_no_checkpoint_and_summaries: no manager, no summary dirs: nothing is written, not
    even relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    trainer = FakeTrainer()
    both(trainer).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10
    assert list(tmp_path.iterdir()) == []


def test_has_checkpoint_no_summaries(tmp_path: Path) -> None:
    """test_has_checkpoint_no_summaries: no event file anywhere (checkpoints dir included).
    Differs from Orbit: without checkpoint_interval Orbit saves nothing; cadence always saves at
    completion and writes checkpoints/FINAL."""
    trainer = FakeTrainer()
    both(trainer, checkpoint_manager=manager(tmp_path)).train_and_evaluate(
        train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10
    assert manager(tmp_path).steps() == [10] and manager(tmp_path).final_step() == 10
    assert (tmp_path / "checkpoints" / "FINAL").is_file()
    assert not list(tmp_path.rglob("events.*")) and not list(tmp_path.rglob("metrics.jsonl"))


def test_has_checkpoint_eval_summary_only(tmp_path: Path) -> None:
    """test_has_checkpoint_eval_summary_only: only eval_summary_dir: eval events there, no train
    events anywhere."""
    trainer = FakeTrainer()
    both(trainer, checkpoint_manager=manager(tmp_path), eval_summary_dir=str(tmp_path / "summaries/eval")
         ).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10
    assert [p.parent for p in tmp_path.rglob("events.*")] == [tmp_path / "summaries/eval"]
    assert tags(tmp_path / "summaries/eval") == {"eval_loss", "steps_per_second"}  # eval_steps=2 > 0
    assert steps_of(tmp_path / "summaries/eval", "eval_loss") == [6, 10]
    assert not list((tmp_path / "checkpoints").glob("events.*"))


def test_restore_from_most_recent_checkpoint(tmp_path: Path) -> None:
    """test_restore_from_most_recent_checkpoint: checkpoint_interval=5, steps_per_loop=5,
    train(20): 4 checkpoints; restore_checkpoint() is restore(), returning the restored step (Orbit:
    its path); a new controller on the same dir restores the latest."""
    trainer = FakeTrainer()
    c = Controller(trainer=trainer, checkpoint_manager=manager(tmp_path), steps_per_loop=5,
                   checkpoint_interval=5, eval_summary_dir=str(tmp_path / "summaries/eval"), progress=False)
    c.train(20)
    assert manager(tmp_path).steps() == [5, 10, 15, 20]
    trainer.step, trainer.value = 3, 6  # the model drifts: restore() brings back the latest
    assert c.restore() == 20
    assert trainer.global_step == 20 and trainer.value == sum(range(1, 21))
    again = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=5, progress=False)
    assert again.restored_step == 20 and again.global_step == 20
    assert again.restore() == 20
    assert not (tmp_path / "summaries/eval").exists()  # training alone writes no eval summaries


@pytest.mark.parametrize("convert", [float, np.float32, np.array], ids=["python", "return_numpy", "return_tensor"])
def test_train_and_evaluate(tmp_path: Path, convert) -> None:
    """test_train_and_evaluate (return_numpy / return_tensor: a NumPy scalar, a 0-d array):
    checkpoint_interval=10: checkpoints are saved; train "loss" and eval "eval_loss" summaries."""
    trainer = ConvertingTrainer(convert)
    c = Controller(trainer=trainer, evaluator=Evaluator(trainer, convert), steps_per_loop=2,
                   checkpoint_manager=manager(tmp_path), checkpoint_interval=10,
                   summary_dir=str(tmp_path / "summaries/train"), eval_summary_dir=str(tmp_path / "summaries/eval"),
                   progress=False)
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert manager(tmp_path).steps() == [10]
    train = [(step, value) for tag, step, value in summaries(tmp_path / "summaries/train") if tag == "loss"]
    assert train == [(s, pytest.approx(1.0 / s)) for s in (2, 4, 6, 8, 10)]
    evals = [(step, value) for tag, step, value in summaries(tmp_path / "summaries/eval") if tag == "eval_loss"]
    assert evals == [(6, pytest.approx(1 / 7)), (10, pytest.approx(1 / 11))]


def test_train_only(tmp_path: Path) -> None:
    """test_train_only: train(steps=10) writes checkpoints and train summaries; the eval summary
    dir is never created."""
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
                   checkpoint_interval=10, summary_dir=str(tmp_path / "summaries/train"),
                   eval_summary_dir=str(tmp_path / "summaries/eval"), progress=False)
    c.train(steps=10)
    assert manager(tmp_path).steps() == [10]
    assert steps_of(tmp_path / "summaries/train", "loss") == [2, 4, 6, 8, 10]
    assert not (tmp_path / "summaries/eval").exists()


def test_evaluate_only(tmp_path: Path) -> None:
    """test_evaluate_only: an evaluator-only controller on a dir with checkpoints evaluates the
    latest, writing eval summaries only; then evaluate_continuously(timeout, timeout_fn) calls
    timeout_fn after the timeout (the run has no FINAL) and stops when it returns True.
    Differs from Orbit: evaluate_continuously evaluates every checkpoint in step order (Orbit:
    the latest only), and the timeout is shortened to 0.2 s."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               checkpoint_interval=2, progress=False).train(4, checkpoint_at_completion=False)
    assert manager(tmp_path).steps() == [2, 4] and manager(tmp_path).final_step() is None

    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False),
                   summary_dir=str(tmp_path / "summaries/train"), eval_summary_dir=str(tmp_path / "summaries/eval"),
                   progress=False)
    assert c.restored_step == 4 and evaluator.loaded == [4]
    results = c.evaluate(steps=2)
    assert set(results) == {"eval_loss", "steps_per_second"} and results["eval_loss"] == pytest.approx(0.2)
    assert results["steps_per_second"] > 0 and evaluator.calls == [(4, 2)]
    assert not (tmp_path / "summaries/train").exists()
    assert steps_of(tmp_path / "summaries/eval", "eval_loss") == [4]

    done = tmp_path / "summaries/eval/Done"
    timeouts: list[float] = []

    def timeout_fn() -> bool:
        timeouts.append(time.monotonic())
        done.write_text("DONE")
        return True

    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False),
                   eval_summary_dir=str(tmp_path / "summaries/eval"), progress=False)
    last = c.evaluate_continuously(timeout=0.2, timeout_fn=timeout_fn, steps=2, poll_interval=0.01)
    assert done.read_text() == "DONE" and len(timeouts) == 1
    assert evaluator.calls == [(2, 2), (4, 2)]
    assert last is not None and last["eval_loss"] == pytest.approx(0.2) and "steps_per_second" in last


def test_evaluate_with_loss_output(tmp_path: Path) -> None:
    """test_evaluate_with_loss_output: an evaluator-only controller restores the checkpoint and
    writes eval_loss at its step."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=3, progress=False).train(3)
    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False),
                   eval_summary_dir=str(tmp_path / "summaries/eval"), progress=False)
    c.evaluate(steps=5)
    assert evaluator.calls == [(3, 5)]
    assert steps_of(tmp_path / "summaries/eval", "eval_loss") == [3]


def test_no_eval_steps(tmp_path: Path) -> None:
    """test_no_eval_steps: evaluate() with no steps evaluates all the data (steps=-1)."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2, progress=False).train(2)
    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False), progress=False)
    assert c.evaluate() == {"eval_loss": pytest.approx(1 / 3)}
    assert evaluator.calls == [(2, -1)]


def test_already_trained_model(tmp_path: Path) -> None:
    """test_already_trained_model: a trainer already at step 10 (restored from the checkpoint at
    10, or simply there) makes train(steps=10) a no-op: no training, no new checkpoint."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               checkpoint_interval=10, progress=False).train(10)
    trainer = FakeTrainer()
    c = Controller(trainer=trainer, checkpoint_manager=manager(tmp_path), steps_per_loop=2,
                   checkpoint_interval=10, progress=False)
    assert c.restored_step == 10
    c.train(steps=10)
    assert trainer.global_step == 10 and trainer.requests == [] and trainer.saves == []

    trainer = FakeTrainer()
    trainer.step = 10  # Orbit: test_runner.global_step.assign(10), no checkpoint
    empty = tmp_path / "empty"
    c = Controller(trainer=trainer, checkpoint_manager=CheckpointManager(str(empty), max_to_keep=None),
                   steps_per_loop=2, checkpoint_interval=10, progress=False)
    c.train(steps=10)
    assert trainer.requests == [] and trainer.saves == []
    assert CheckpointManager(str(empty), max_to_keep=None).steps() == []


# Orbit's test_summaries_inside_train_fn has no cadence counterpart: it tests tf.summary calls made
# inside a tf.function train step (and StandardTrainerOptions.use_tpu_summary_optimization) under
# the controller's summary_interval. cadence has no ambient summary writer: a trainer returns its
# logs to the loop, which writes them (test_train_only and test_train_and_evaluate cover that).


def test_train_and_evaluate_with_same_summary_dir(tmp_path: Path) -> None:
    """test_train_and_evaluate_with_same_summary_dir: summary_dir == eval_summary_dir: both the
    train "loss" and the "eval_loss" summaries are in that one directory."""
    summaries_dir = str(tmp_path / "summaries")
    both(FakeTrainer(), checkpoint_manager=manager(tmp_path), summary_dir=summaries_dir,
         eval_summary_dir=summaries_dir).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert steps_of(tmp_path / "summaries", "loss") == [2, 4, 6, 8, 10]
    assert steps_of(tmp_path / "summaries", "eval_loss") == [6, 10]


def test_train_and_evaluate_reset_datasets(tmp_path: Path) -> None:
    """test_train_and_evaluate_reset_datasets: train_and_evaluate called again on a trainer that
    reached train_steps trains nothing more (Orbit replaces the datasets in between; the fake has
    none)."""
    trainer = FakeTrainer()
    c = both(trainer)
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    requests = list(trainer.requests)
    assert sum(requests) == 10
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.global_step == 10 and trainer.requests == requests


def test_early_stop_on_eval_loss(tmp_path: Path) -> None:
    """test_early_stop_on_eval_loss. Differs from Orbit: Orbit subclasses the Controller; in
    cadence an eval action raises StopTraining, train_and_evaluate ends before train_steps, and
    the final checkpoint and FINAL are written at the stop step."""
    def stop_when_low(metrics) -> None:
        if metrics["eval_loss"] < 0.15:
            raise StopTraining("eval_loss below 0.15")

    trainer = FakeTrainer()
    c = both(trainer, checkpoint_manager=manager(tmp_path), checkpoint_interval=10, eval_actions=[stop_when_low])
    c.train_and_evaluate(train_steps=10, eval_steps=6, eval_interval=2)
    assert trainer.global_step < 10
    assert trainer.global_step == 6 and c.stop_reason == "eval_loss below 0.15"
    assert c.evaluator.calls == [(2, 6), (4, 6), (6, 6)]
    assert manager(tmp_path).steps() == [6] and manager(tmp_path).final_step() == 6


def test_evaluate_with_no_output(tmp_path: Path) -> None:
    """test_evaluate_with_no_output: an evaluator returning None gives only ``steps_per_second``
    (steps=5 > 0; Orbit's assertSameElements(["steps_per_second"], ...)); with steps=-1, {}."""
    class NoOutput:
        def evaluate(self, num_steps):
            return None

    c = Controller(evaluator=NoOutput(), eval_summary_dir=str(tmp_path / "summaries/eval"), progress=False)
    assert set(c.evaluate(steps=5)) == {"steps_per_second"}
    assert c.evaluate() == {}


def test_eval_and_checkpoint_interval(tmp_path: Path) -> None:
    """test_eval_and_checkpoint_interval: steps_per_loop=10, checkpoint_interval=5, eval_interval=5,
    one summary dir: checkpoints at 5 and 10, two evaluations (5 and 10). (cadence cuts segments
    at multiples of eval_interval, so the loops are 5 steps each.)"""
    trainer = FakeTrainer()
    c = Controller(trainer=trainer, evaluator=Evaluator(trainer), steps_per_loop=10,
                   checkpoint_manager=manager(tmp_path), checkpoint_interval=5, summary_dir=str(tmp_path),
                   progress=False)
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=5)
    assert manager(tmp_path).steps() == [5, 10]
    assert steps_of(tmp_path, "eval_loss") == [5, 10]
    assert trainer.requests == [5, 5]


def test_evaluate_with_nested_summaries(tmp_path: Path) -> None:
    """test_evaluate_with_nested_summaries: a nested output's top-level keys get a subdirectory
    each, holding their entries as tags."""
    class TwoDatasets:
        def evaluate(self, num_steps):
            return {"dataset": {"loss": 0.5, "accuracy": 0.25}, "dataset2": {"loss": 0.75, "accuracy": 0.125}}

    Controller(evaluator=TwoDatasets(), eval_summary_dir=str(tmp_path), progress=False).evaluate(steps=5)
    assert sorted(summaries(tmp_path / "dataset")) == [("accuracy", 0, 0.25), ("loss", 0, 0.5)]
    assert sorted(summaries(tmp_path / "dataset2")) == [("accuracy", 0, 0.125), ("loss", 0, 0.75)]
    assert not {"dataset/loss", "dataset2/loss"} & tags(tmp_path)  # not also flattened at the top


# ------------------------------------------------------------------ deliberate differences


def test_train_none_runs_until_data_exhausted(tmp_path: Path) -> None:
    """Differs from Orbit: train(steps=-1) is unsupported there; cadence's train(None) trains until
    the trainer advances fewer steps than asked, then saves the final checkpoint and FINAL."""
    trainer = FakeTrainer(data=7)
    Controller(trainer=trainer, checkpoint_manager=manager(tmp_path), steps_per_loop=3, progress=False).train(None)
    assert trainer.global_step == 7
    assert manager(tmp_path).steps() == [7] and manager(tmp_path).final_step() == 7


def test_evaluate_continuously_stops_after_final(tmp_path: Path) -> None:
    """Differs from Orbit: evaluate_continuously stops once it has evaluated the FINAL checkpoint,
    without waiting for the timeout (Orbit waits for timeout, then asks timeout_fn)."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               checkpoint_interval=2, progress=False).train(4)
    assert manager(tmp_path).final_step() == 4
    calls: list[bool] = []
    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False), restore=False,
                   progress=False)
    start = time.monotonic()
    last = c.evaluate_continuously(steps=2, timeout=30, timeout_fn=lambda: calls.append(True) or True,
                                   poll_interval=0.01)
    assert time.monotonic() - start < 10 and calls == []
    assert evaluator.calls == [(2, 2), (4, 2)] and last is not None
    assert last["eval_loss"] == pytest.approx(0.2) and set(last) == {"eval_loss", "steps_per_second"}


# ------------------------------------------------------------------ actions/conditional_action_test.py


def test_conditional_action() -> None:
    """test_conditional_action: a False condition runs nothing; a True one runs the action, whose
    exception propagates with the output in its message."""
    def raise_assertion(arg):
        raise AssertionError(str(arg))

    action = ConditionalAction(condition=lambda x: x["value"], action=raise_assertion)
    action({"value": False})  # nothing is raised
    with pytest.raises(AssertionError) as excinfo:
        action({"value": True})
    assert str(excinfo.value) == "{'value': True}"


# ------------------------------------------------------------------ actions/new_best_metric_test.py


def test_new_best_metric_higher_is_better() -> None:
    """test_new_best_metric_higher_is_better: a callable metric; test() records nothing, commit()
    does; an equal value is not a new best."""
    best = NewBestMetric(lambda x: x["value"], higher_is_better=True)
    assert best.test({"value": 0.0})
    assert best.commit({"value": 0.0})
    assert not best.test({"value": 0.0})
    assert best.test({"value": 1.0})


def test_new_best_metric_lower_is_better() -> None:
    """test_new_best_metric_lower_is_better: a metric key."""
    best = NewBestMetric("value", higher_is_better=False)
    assert best.test({"value": 0.0})
    assert best.commit({"value": 0.0})
    assert not best.test({"value": 0.0})
    assert best.test({"value": -1.0})


def test_new_best_metric_persistence(tmp_path: Path) -> None:
    """test_new_best_metric_persistence: write_metric=False commits in memory only; a new instance
    on the file starts afresh, commits 5.0, and the next instance reads 5.0 back. Differs from
    Orbit: Orbit's backing file exists and is empty (cadence refuses an empty file, see
    test_json_persisted_value_refuses_a_corrupt_file), so the file is absent here; and a fresh
    best is None, not Orbit's -sys.float_info.max."""
    path = tmp_path / "best_metric.json"
    best = NewBestMetric("value", higher_is_better=True, filename=str(path), write_metric=False)
    assert best.test({"value": 0.0})
    assert best.commit({"value": 0.0})
    assert not best.test({"value": 0.0})
    assert not path.exists()  # nothing written

    best = NewBestMetric("value", higher_is_better=True, filename=str(path))
    assert best.best_value is None
    assert best.commit({"value": 5.0})
    assert best.best_value == 5.0
    assert json.loads(path.read_text()) == 5.0

    best = NewBestMetric("value", higher_is_better=True, filename=str(path))
    assert best.best_value == 5.0
    assert not best.test({"value": 5.0}) and best.test({"value": 6.0})

    reader = NewBestMetric("value", higher_is_better=True, filename=str(path), write_metric=False)
    assert reader.best_value == 5.0 and reader.commit({"value": 7.0})
    assert NewBestMetric("value", higher_is_better=True, filename=str(path)).best_value == 5.0


def test_json_persisted_value(tmp_path: Path) -> None:
    """test_json_persisted_value: the initial value is used (and written) when the file is absent;
    a second instance ignores its initial value and reads the file; write() then a new instance
    reads the new value; write_value=False never writes. (Orbit starts from an existing empty
    file, which cadence refuses; here the file is absent.)"""
    path = str(tmp_path / "value")
    value = {"a": 1, "b": 2}
    persisted = JSONPersistedValue(value, path)
    assert persisted.read() == value
    persisted = JSONPersistedValue("ignored", path)
    assert persisted.read() == value
    persisted.write([1, 2, 3])
    persisted = JSONPersistedValue(["also ignored"], path)
    assert persisted.read() == [1, 2, 3]
    persisted = JSONPersistedValue("ignored", path, write_value=False)
    assert persisted.read() == [1, 2, 3]
    persisted.write("won't get persisted")
    assert persisted.read() == "won't get persisted"  # in memory only
    persisted = JSONPersistedValue("ignored", path, write_value=False)
    assert persisted.read() == [1, 2, 3]
    assert json.loads(Path(path).read_text()) == [1, 2, 3]


def test_json_persisted_value_create_dirs(tmp_path: Path) -> None:
    """test_json_persisted_value_create_dirs: write_value=False creates no directory; True creates
    the parent directories and the file."""
    path = tmp_path / "subdir" / "value"
    JSONPersistedValue({"a": 1, "b": 2}, str(path), write_value=False)
    assert not path.parent.exists()
    JSONPersistedValue({"a": 1, "b": 2}, str(path))
    assert path.parent.is_dir() and json.loads(path.read_text()) == {"a": 1, "b": 2}


@pytest.mark.parametrize("content", ["", "   \n", "{not json"], ids=["empty", "blank", "corrupt"])
def test_json_persisted_value_refuses_a_corrupt_file(tmp_path: Path, content: str) -> None:
    """Differs from Orbit: Orbit silently resets an empty or corrupt file to the initial value;
    cadence raises PersistedValueError naming the file, and leaves the file alone."""
    path = tmp_path / "value"
    path.write_text(content)
    with pytest.raises(PersistedValueError, match=str(path)):
        JSONPersistedValue({"a": 1}, str(path))
    assert path.read_text() == content


# ------------------------------------------------------------------ actions/export_saved_model_test.py


def listing(directory: Path) -> list[str]:
    """Orbit's _id_sorted_file_base_names."""
    return sorted(os.listdir(directory), key=lambda name: int(name.rsplit("-", 1)[1]))


def test_export_file_manager_default_ids(tmp_path: Path) -> None:
    """test_export_file_manager_default_ids: base-0, base-1, ...; clean_up keeps max_to_keep=3,
    deleting the lowest id; a new manager continues after the highest id."""
    base_name = str(tmp_path / "basename")
    m = ExportFileManager(base_name, max_to_keep=3)
    assert os.listdir(tmp_path) == []
    for count in (1, 2, 3):
        Path(m.next_name()).write_text("x")
        assert m.clean_up() == []  # shouldn't do anything
        assert len(os.listdir(tmp_path)) == count
    Path(m.next_name()).write_text("x")
    assert listing(tmp_path) == ["basename-0", "basename-1", "basename-2", "basename-3"]
    m.clean_up()  # deletes the lowest id
    assert listing(tmp_path) == ["basename-1", "basename-2", "basename-3"]
    m = ExportFileManager(base_name, max_to_keep=3)
    assert os.path.basename(m.next_name()) == "basename-4"


def test_export_file_manager_custom_ids(tmp_path: Path) -> None:
    """test_export_file_manager_custom_ids: next_id_fn gives 30, 200, 1000; ids order the members
    numerically; clean_up with max_to_keep=2 keeps 200 and 1000."""
    base_name = str(tmp_path / "basename")
    id_num = 0
    m = ExportFileManager(base_name, max_to_keep=2, next_id_fn=lambda: id_num)
    assert os.listdir(tmp_path) == []
    id_num = 30
    Path(m.next_name()).write_text("x")
    m.clean_up()  # shouldn't do anything
    assert listing(tmp_path) == ["basename-30"]
    id_num = 200
    Path(m.next_name()).write_text("x")
    m.clean_up()  # shouldn't do anything
    assert listing(tmp_path) == ["basename-30", "basename-200"]
    id_num = 1000
    Path(m.next_name()).write_text("x")
    assert listing(tmp_path) == ["basename-30", "basename-200", "basename-1000"]
    m.clean_up()  # deletes the lowest id
    assert listing(tmp_path) == ["basename-200", "basename-1000"]


def _create_managed_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("basename-5", "basename-10", "basename-50", "basename-1000", "basename-9", "basename-10-suffix"):
        (directory / name).write_text("x")


def test_export_file_manager_managed_files(tmp_path: Path) -> None:
    """test_export_file_manager_managed_files: 'basename-10-suffix' is not a member; members sort
    by integer id; the next name after 1000 is 1001; clean_up keeps the 3 highest ids."""
    _create_managed_files(tmp_path)
    base_name = str(tmp_path / "basename")
    m = ExportFileManager(base_name, max_to_keep=3)
    assert m.managed_files == [f"{base_name}-{i}" for i in (5, 9, 10, 50, 1000)]
    assert m.next_name() == f"{base_name}-1001"
    m.clean_up()
    assert m.managed_files == [f"{base_name}-10", f"{base_name}-50", f"{base_name}-1000"]
    assert (tmp_path / "basename-10-suffix").exists()


def test_export_file_manager_managed_files_double_slash(tmp_path: Path) -> None:
    """test_export_file_manager_managed_files_double_slash: a base name with '//' is normalised:
    managed_files and next_name use os.path.normpath(base_name)."""
    directory = tmp_path / "foo" / "bar"
    _create_managed_files(directory)
    base_name = f"{tmp_path}/foo//bar/basename"
    expected_base_name = os.path.normpath(base_name)
    assert base_name != expected_base_name
    m = ExportFileManager(base_name, max_to_keep=3)
    assert len(m.managed_files) == 5
    assert m.next_name() == f"{expected_base_name}-1001"
    m.clean_up()
    assert m.managed_files == [f"{expected_base_name}-10", f"{expected_base_name}-50",
                               f"{expected_base_name}-1000"]


def test_export_file_manager_subdirectory(tmp_path: Path) -> None:
    """ExportFileManager(subdirectory=...) (Orbit's newer option; keyword-only in cadence): names
    are base-<id>/<subdirectory>; only ids whose subdirectory exists are members; clean_up deletes
    the old subdirectories alone, leaving the rest of base-<id>/ in place."""
    base_name = str(tmp_path / "basename")
    m = ExportFileManager(base_name, max_to_keep=2, subdirectory="saved_model")
    names = []
    for i in range(3):
        name = m.next_name()
        assert name == f"{base_name}-{i}/saved_model"
        Path(name).mkdir(parents=True)
        (Path(name) / "model.bin").write_text("x")
        (tmp_path / f"basename-{i}" / "other.txt").write_text("kept")
        names.append(name)
    (tmp_path / "basename-9").mkdir()  # no saved_model inside: not a member
    assert m.managed_files == names
    assert m.clean_up() == [names[0]]
    assert not Path(names[0]).exists()
    assert (tmp_path / "basename-0" / "other.txt").read_text() == "kept"
    assert m.managed_files == names[1:]
    assert ExportFileManager(base_name, subdirectory="saved_model").next_name() == f"{base_name}-3/saved_model"


def test_without_a_checkpoint_manager_save_and_restore_return_none() -> None:
    """Differs from Orbit (which raises ValueError): without a manager both are no-ops."""
    c = Controller(trainer=FakeTrainer(), steps_per_loop=2, progress=False)
    assert c.save_checkpoint() is None and c.restore() is None
