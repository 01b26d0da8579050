"""Orbit's own tests (orbit/controller_test.py, orbit/actions/*_test.py) ported to cadence: the
contract Orbit users rely on, with a fake trainer and evaluator, real checkpoints and real
TensorBoard event files. Where cadence differs on purpose (README, "Deliberate differences from
Orbit"), the test asserts cadence's behaviour and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cadence import Controller, StopTraining
from cadence.actions import ConditionalAction, ExportFileManager, JSONPersistedValue, NewBestMetric
from cadence.actions.persisted import PersistedValueError
from cadence.checkpoint import CheckpointManager
from fakes import MODEL_FILE, FakeTrainer


class Evaluator:
    """Orbit's TestRunner as an evaluator: ``eval_loss`` of the model it evaluates."""

    def __init__(self, trainer: FakeTrainer | None = None) -> None:
        self.trainer = trainer
        self.loaded: list[int] = []
        self.calls = 0

    def evaluate(self, num_steps: int):
        self.calls += 1
        step = self.trainer.step if self.trainer is not None else (self.loaded[-1] if self.loaded else 0)
        return {"eval_loss": 1.0 / (1 + step)}

    def load_checkpoint(self, reader, state):
        self.loaded.append(json.loads(reader.read(MODEL_FILE))["step"])


def tags(logdir: Path) -> dict[str, list[int]]:
    """The scalar tags of the TensorBoard events in ``logdir``, with their steps."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=None, **kw)


def both(trainer: FakeTrainer, **kw) -> Controller:
    return Controller(trainer=trainer, evaluator=Evaluator(trainer), steps_per_loop=2, progress=False, **kw)


# ------------------------------------------------------------------ controller_test.py


def test_no_checkpoint(tmp_path: Path) -> None:
    """test_no_checkpoint: summaries without a checkpoint manager; a reset trainer runs again."""
    trainer = FakeTrainer()
    c = both(trainer, summary_dir=str(tmp_path / "summaries/train"), eval_summary_dir=str(tmp_path / "summaries/eval"))
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.step == 10
    assert tags(tmp_path / "summaries/train")["loss"] == [2, 4, 6, 8, 10]
    assert tags(tmp_path / "summaries/eval")["eval_loss"] == [6, 10]
    trainer.step = 0  # no checkpoint: the global step starts from 0 again
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.step == 10


def test_no_checkpoint_and_summaries(tmp_path: Path) -> None:
    """test_no_checkpoint_and_summaries: nothing is written anywhere."""
    trainer = FakeTrainer()
    both(trainer).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert trainer.step == 10 and list(tmp_path.iterdir()) == []


def test_has_checkpoint_no_summaries(tmp_path: Path) -> None:
    """test_has_checkpoint_no_summaries; differs from Orbit: the final checkpoint is always saved."""
    trainer = FakeTrainer()
    both(trainer, checkpoint_manager=manager(tmp_path)).train_and_evaluate(train_steps=10, eval_steps=2,
                                                                          eval_interval=6)
    assert trainer.step == 10 and manager(tmp_path).steps() == [10]
    assert not list(tmp_path.rglob("events.*"))


def test_has_checkpoint_eval_summary_only(tmp_path: Path) -> None:
    """test_has_checkpoint_eval_summary_only: eval events only."""
    both(FakeTrainer(), checkpoint_manager=manager(tmp_path), eval_summary_dir=str(tmp_path / "eval")
         ).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert [p.parent.name for p in tmp_path.rglob("events.*")] == ["eval"]


def test_restore_from_most_recent_checkpoint(tmp_path: Path) -> None:
    """test_restore_from_most_recent_checkpoint: restore_checkpoint() is restore() (a step)."""
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=5,
                   checkpoint_interval=5, progress=False)
    c.train(20)
    assert manager(tmp_path).steps() == [5, 10, 15, 20]
    assert c.restore() == 20
    again = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=5, progress=False)
    assert again.restored_step == 20 and again.global_step == 20


def test_train_and_evaluate(tmp_path: Path) -> None:
    """test_train_and_evaluate: checkpoints and both kinds of summaries."""
    both(FakeTrainer(), checkpoint_manager=manager(tmp_path), checkpoint_interval=10,
         summary_dir=str(tmp_path / "train"), eval_summary_dir=str(tmp_path / "eval")
         ).train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    assert manager(tmp_path).steps() == [10]
    assert "loss" in tags(tmp_path / "train") and "eval_loss" in tags(tmp_path / "eval")


def test_train_only(tmp_path: Path) -> None:
    """test_train_only: train summaries; the eval summary dir is never created."""
    c = Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
                   checkpoint_interval=10, summary_dir=str(tmp_path / "train"),
                   eval_summary_dir=str(tmp_path / "eval"), progress=False)
    c.train(steps=10)
    assert manager(tmp_path).steps() == [10]
    assert "loss" in tags(tmp_path / "train") and not (tmp_path / "eval").exists()


def test_evaluate_only_and_continuous_evaluation_timeout_fn(tmp_path: Path) -> None:
    """test_evaluate_only: eval summaries only; evaluate_continuously calls timeout_fn on timeout."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               progress=False).train(2, checkpoint_at_completion=False)
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               checkpoint_interval=2, progress=False).train(4, checkpoint_at_completion=False)  # no FINAL
    evaluator = Evaluator()
    c = Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False),
                   summary_dir=str(tmp_path / "train"), eval_summary_dir=str(tmp_path / "eval"), progress=False)
    results = c.evaluate(steps=2)
    assert "eval_loss" in results and not (tmp_path / "train").exists()
    assert tags(tmp_path / "eval") == {"eval_loss": [4]}
    done = tmp_path / "eval" / "Done"

    def timeout_fn() -> bool:
        done.write_text("DONE")
        return True

    Controller(evaluator=evaluator, checkpoint_manager=manager(tmp_path, writer=False), restore=False,
               eval_summary_dir=str(tmp_path / "eval"), progress=False).evaluate_continuously(
        timeout=0.2, timeout_fn=timeout_fn, steps=2, poll_interval=0.01)
    assert done.read_text() == "DONE"


def test_no_eval_steps(tmp_path: Path) -> None:
    """test_no_eval_steps: evaluate() evaluates all the data (-1)."""
    evaluator = Evaluator()
    assert Controller(evaluator=evaluator, progress=False).evaluate() == {"eval_loss": 1.0}


def test_already_trained_model(tmp_path: Path) -> None:
    """test_already_trained_model: train(steps) at that step is a no-op."""
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager(tmp_path), steps_per_loop=2,
               progress=False).train(10)
    trainer = FakeTrainer()
    Controller(trainer=trainer, checkpoint_manager=manager(tmp_path), steps_per_loop=2, progress=False).train(10)
    assert trainer.step == 10 and trainer.requests == []


def test_train_and_evaluate_with_same_summary_dir(tmp_path: Path) -> None:
    """test_train_and_evaluate_with_same_summary_dir: both in one directory."""
    both(FakeTrainer(), summary_dir=str(tmp_path), eval_summary_dir=str(tmp_path)).train_and_evaluate(
        train_steps=10, eval_steps=2, eval_interval=6)
    found = tags(tmp_path)
    assert "loss" in found and "eval_loss" in found


def test_early_stop_on_eval_loss(tmp_path: Path) -> None:
    """test_early_stop_on_eval_loss; differs from Orbit (a Controller subclass there): an eval
    action raises StopTraining, and the final checkpoint and FINAL are written at the stop."""
    def stop_when_low(metrics) -> None:
        if metrics["eval_loss"] < 0.2:
            raise StopTraining("eval_loss below 0.2")

    trainer = FakeTrainer()
    c = both(trainer, checkpoint_manager=manager(tmp_path), eval_actions=[stop_when_low])
    c.train_and_evaluate(train_steps=10, eval_steps=6, eval_interval=2)
    assert trainer.step == 6 and c.stop_reason == "eval_loss below 0.2"
    assert manager(tmp_path).steps() == [6] and manager(tmp_path).final_step() == 6


def test_evaluate_with_no_output(tmp_path: Path) -> None:
    """test_evaluate_with_no_output: an evaluator returning None gives {}."""
    class NoOutput:
        def evaluate(self, num_steps):
            return None

    assert Controller(evaluator=NoOutput(), eval_summary_dir=str(tmp_path), progress=False).evaluate(steps=5) == {}


def test_eval_and_checkpoint_interval(tmp_path: Path) -> None:
    """test_eval_and_checkpoint_interval: steps_per_loop=10 with interval 5; differs from Orbit:
    segments are cut at eval_interval, so evaluations and checkpoints land on 5 and 10."""
    c = Controller(trainer=(trainer := FakeTrainer()), evaluator=Evaluator(trainer), steps_per_loop=10,
                   checkpoint_manager=manager(tmp_path), checkpoint_interval=5, summary_dir=str(tmp_path / "s"),
                   progress=False)
    c.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=5)
    assert manager(tmp_path).steps() == [5, 10]
    assert tags(tmp_path / "s")["eval_loss"] == [5, 10]


def test_evaluate_with_nested_summaries(tmp_path: Path) -> None:
    """test_evaluate_with_nested_summaries: a subdirectory per top-level key."""
    class TwoDatasets:
        def evaluate(self, num_steps):
            return {"dataset": {"loss": 0.5, "accuracy": 0.9}, "dataset2": {"loss": 0.6, "accuracy": 0.8}}

    Controller(evaluator=TwoDatasets(), eval_summary_dir=str(tmp_path), progress=False).evaluate(steps=5)
    for name in ("dataset", "dataset2"):
        assert sorted(tags(tmp_path / name)) == ["accuracy", "loss"]


# Orbit's test_summaries_inside_train_fn has no counterpart: cadence's trainers return their logs
# to the loop, which writes them; nothing writes summaries from inside a step.


# ------------------------------------------------------------------ actions tests


def test_conditional_action() -> None:
    def raise_assertion(arg):
        raise AssertionError(str(arg))

    action = ConditionalAction(condition=lambda x: x["value"], action=raise_assertion)
    action({"value": False})  # nothing is raised
    with pytest.raises(AssertionError, match=r"\{'value': True\}"):
        action({"value": True})


def test_new_best_metric_higher_and_lower_is_better() -> None:
    higher = NewBestMetric(lambda x: x["value"], higher_is_better=True)
    assert higher.test({"value": 0.0}) and higher.commit({"value": 0.0})
    assert not higher.test({"value": 0.0}) and higher.test({"value": 1.0})
    lower = NewBestMetric("value", higher_is_better=False)
    assert lower.test({"value": 0.0}) and lower.commit({"value": 0.0})
    assert not lower.test({"value": 0.0}) and lower.test({"value": -1.0})


def test_new_best_metric_persistence(tmp_path: Path) -> None:
    path = str(tmp_path / "best")
    best = NewBestMetric("value", higher_is_better=True, filename=path)
    assert best.commit({"value": 5.0}) and best.best_value == 5.0
    assert NewBestMetric("value", higher_is_better=True, filename=path).best_value == 5.0


def test_json_persisted_value(tmp_path: Path) -> None:
    path = str(tmp_path / "value")
    assert JSONPersistedValue({"a": 1, "b": 2}, path).read() == {"a": 1, "b": 2}
    persisted = JSONPersistedValue("ignored", path)  # the file wins over the initial value
    assert persisted.read() == {"a": 1, "b": 2}
    persisted.write([1, 2, 3])
    assert JSONPersistedValue(["also ignored"], path).read() == [1, 2, 3]
    reader = JSONPersistedValue("ignored", path, write_value=False)
    reader.write("won't get persisted")
    assert JSONPersistedValue("ignored", path, write_value=False).read() == [1, 2, 3]
    (tmp_path / "value").write_text("")  # differs from Orbit: a corrupt file is refused, not reset
    with pytest.raises(PersistedValueError, match="the file is empty"):
        JSONPersistedValue("ignored", path)


def test_json_persisted_value_creates_directories_only_when_writing(tmp_path: Path) -> None:
    path = tmp_path / "subdir" / "value"
    JSONPersistedValue({"a": 1}, str(path), write_value=False)
    assert not path.parent.exists()
    JSONPersistedValue({"a": 1}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}


def test_export_file_manager_default_and_custom_ids(tmp_path: Path) -> None:
    base = str(tmp_path / "basename")
    m = ExportFileManager(base, max_to_keep=3)
    for _ in range(4):
        Path(m.next_name()).write_text("x")
    assert m.managed_files == [f"{base}-{i}" for i in range(4)]
    m.clean_up()  # deletes the lowest id
    assert m.managed_files == [f"{base}-{i}" for i in (1, 2, 3)]
    assert ExportFileManager(base, max_to_keep=3).next_name() == f"{base}-4"
    ids = iter([30, 200, 1000])
    custom = ExportFileManager(str(tmp_path / "custom"), max_to_keep=2, next_id_fn=lambda: next(ids))
    for _ in range(3):
        Path(custom.next_name()).write_text("x")
    custom.clean_up()
    assert custom.managed_ids == [200, 1000]


def test_export_file_manager_managed_files(tmp_path: Path) -> None:
    for name in ("basename-5", "basename-10", "basename-50", "basename-1000", "basename-9", "basename-10-suffix"):
        (tmp_path / name).write_text("x")
    base = str(tmp_path / "basename")
    m = ExportFileManager(base, max_to_keep=3)
    assert len(m.managed_files) == 5
    assert m.next_name() == f"{base}-1001"
    m.clean_up()
    assert m.managed_files == [f"{base}-10", f"{base}-50", f"{base}-1000"]
    assert (tmp_path / "basename-10-suffix").exists()
