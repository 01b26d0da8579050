"""EarlyStopping with the real Controller and the real CheckpointManager (no torch): the stop step,
the final checkpoint and FINAL, and a resumed run that stops where the uninterrupted one did
because the patience count came back from the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence import Controller
from cadence.actions import EarlyStopping
from cadence.checkpoint import CheckpointManager
from fakes import FakeTrainer

ES_KEY = "eval_actions/0/EarlyStopping"


class FakeEvaluator:
    """``{name: values[step // every - 1]}``: the n-th evaluation step gets the n-th value."""

    def __init__(self, trainer: FakeTrainer, values: list[float], every: int = 5, name: str = "accuracy") -> None:
        self.trainer, self.values, self.every, self.name = trainer, values, every, name
        self.calls: list[int] = []

    def evaluate(self, num_steps: int):
        step = self.trainer.step
        self.calls.append(step)
        return {self.name: self.values[step // self.every - 1]}


class InterruptAt:
    """A train action that raises KeyboardInterrupt after the inner loop ending at ``step``."""

    def __init__(self, trainer: FakeTrainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def __call__(self, output):
        if self.trainer.global_step == self.step:
            raise KeyboardInterrupt


def ckpt_manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"), **kw)


def build(model_dir: Path, values, *, patience=2, train_actions=(), **es_kwargs):
    trainer = FakeTrainer()
    evaluator = FakeEvaluator(trainer, values, name=es_kwargs.pop("name", "accuracy"))
    stopper = EarlyStopping(es_kwargs.pop("metric", "accuracy"), patience=patience, **es_kwargs)
    controller = Controller(
        trainer=trainer, evaluator=evaluator, checkpoint_manager=ckpt_manager(model_dir, max_to_keep=None),
        steps_per_loop=5, checkpoint_interval=5, eval_actions=[stopper],
        train_actions=[a(trainer) for a in train_actions], progress=False,
    )
    return controller, trainer, evaluator, stopper


PLATEAU = [0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]  # evaluations at steps 5, 10, ...


def test_plateau_stops_at_exactly_patience_with_final_checkpoint(tmp_path):
    controller, trainer, evaluator, stopper = build(tmp_path, PLATEAU)
    metrics = controller.train_and_evaluate(train_steps=50, eval_interval=5)

    # 5: best 0.5; 10: best 0.6; 15: wait 1; 20: wait 2 == patience -> stop
    assert trainer.global_step == 20
    assert evaluator.calls == [5, 10, 15, 20]
    assert metrics == {"accuracy": 0.6}
    assert controller.stop_reason is not None
    assert "accuracy" in controller.stop_reason and "step 10" in controller.stop_reason
    assert (stopper.best_value, stopper.best_step, stopper.wait) == (0.6, 10, 2)

    manager = ckpt_manager(tmp_path, writer=False)
    assert manager.steps() == [5, 10, 15, 20]
    assert manager.final_step() == 20
    final = manager.read_state(20)["state"]
    assert final[ES_KEY]["wait"] == 2 and final[ES_KEY]["best_step"] == 10
    assert final["controller"] == {"last_eval_step": 20}
    # each checkpoint holds the state after the evaluation at its own step
    assert [manager.read_state(s)["state"][ES_KEY]["wait"] for s in (5, 10, 15)] == [0, 0, 1]
    controller.close()


def uninterrupted(model_dir: Path):
    controller, trainer, _, stopper = build(model_dir, PLATEAU)
    controller.train_and_evaluate(train_steps=50, eval_interval=5)
    controller.close()
    return trainer, stopper


def test_resume_after_an_interruption_stops_at_the_same_step(tmp_path):
    ref_trainer, ref_stopper = uninterrupted(tmp_path / "ref")

    model_dir = tmp_path / "run"
    # killed after the loop ending at 20: the last committed checkpoint is 15, where wait == 1
    controller, trainer, _, _ = build(model_dir, PLATEAU, train_actions=[lambda t: InterruptAt(t, 20)])
    with pytest.raises(KeyboardInterrupt):
        controller.train_and_evaluate(train_steps=50, eval_interval=5)
    manager = ckpt_manager(model_dir, writer=False)
    assert manager.steps() == [5, 10, 15] and manager.final_step() is None
    assert manager.read_state(15)["state"][ES_KEY]["wait"] == 1

    controller, trainer, evaluator, stopper = build(model_dir, PLATEAU)  # fresh process
    assert controller.restored_step == 15
    assert (stopper.best_value, stopper.best_step, stopper.wait) == (0.6, 10, 1)
    controller.train_and_evaluate(train_steps=50, eval_interval=5)

    assert evaluator.calls == [20]  # 15 was evaluated before the interruption: not again
    assert trainer.global_step == ref_trainer.global_step == 20
    assert trainer.value == ref_trainer.value
    assert stopper.state_dict() == ref_stopper.state_dict()
    assert manager.final_step() == 20
    assert manager.steps() == [5, 10, 15, 20]
    controller.close()


def test_resume_from_a_run_completed_at_a_shorter_target(tmp_path):
    """Two train_and_evaluate calls in two processes: the first ends (FINAL) at 15 with wait 1;
    the second extends the target and stops at 20 as the uninterrupted run does."""
    controller, _, _, _ = build(tmp_path, PLATEAU)
    controller.train_and_evaluate(train_steps=15, eval_interval=5)
    manager = ckpt_manager(tmp_path, writer=False)
    assert manager.final_step() == 15 and controller.stop_reason is None

    controller, trainer, evaluator, stopper = build(tmp_path, PLATEAU)
    assert stopper.wait == 1
    controller.train_and_evaluate(train_steps=50, eval_interval=5)
    assert evaluator.calls == [20]
    assert trainer.global_step == 20 and manager.final_step() == 20


def test_without_resumed_state_the_run_would_stop_later():
    """Control for the resume tests: a fresh EarlyStopping that did NOT get its count back (no
    checkpoint manager) stops later, so the tests above do test the restore."""
    trainer = FakeTrainer()
    trainer.train(15)
    stopper = EarlyStopping("accuracy", patience=2)
    evaluator = FakeEvaluator(trainer, PLATEAU)
    controller = Controller(trainer=trainer, evaluator=evaluator, steps_per_loop=5,
                            eval_actions=[stopper], progress=False)
    controller.train_and_evaluate(train_steps=50, eval_interval=5)
    # no last_eval_step: 15 is evaluated first (0.6 becomes the best), then 20 (wait 1), 25 (wait 2)
    assert evaluator.calls == [15, 20, 25]
    assert trainer.global_step == 25


def test_min_delta_through_the_controller(tmp_path):
    # 0.5 best; 0.55 and 0.58 are not > 0.5 + 0.1 -> wait 1, 2 -> stop at 15 (best stays 0.5)
    controller, trainer, _, stopper = build(tmp_path, [0.5, 0.55, 0.58, 0.9, 0.9], min_delta=0.1)
    controller.train_and_evaluate(train_steps=50, eval_interval=5)
    assert trainer.global_step == 15
    assert (stopper.best_value, stopper.best_step) == (0.5, 5)
    assert "by more than 0.1" in controller.stop_reason
    assert ckpt_manager(tmp_path, writer=False).final_step() == 15


def test_lower_is_better_through_the_controller(tmp_path):
    # 1.0 best; 0.8 best; 0.9, 0.85 worse -> stop at 20 with best 0.8 at step 10
    controller, trainer, _, stopper = build(
        tmp_path, [1.0, 0.8, 0.9, 0.85, 0.1], metric="val_loss", name="val_loss", higher_is_better=False
    )
    controller.train_and_evaluate(train_steps=50, eval_interval=5)
    assert trainer.global_step == 20
    assert (stopper.best_value, stopper.best_step, stopper.wait) == (0.8, 10, 2)
    assert "has not decreased" in controller.stop_reason
    assert ckpt_manager(tmp_path, writer=False).final_step() == 20


def test_improvement_before_patience_runs_out_keeps_training(tmp_path):
    controller, trainer, _, stopper = build(tmp_path, [0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.7])
    controller.train_and_evaluate(train_steps=30, eval_interval=5)
    assert trainer.global_step == 30 and controller.stop_reason is None
    assert (stopper.best_value, stopper.best_step, stopper.wait) == (0.7, 25, 1)
    assert ckpt_manager(tmp_path, writer=False).final_step() == 30
