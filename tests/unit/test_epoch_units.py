"""Epochs as a unit (issue 40, items 5-7): an LR scheduler stepped per epoch (``LRSchedule(...,
interval="epoch")``) and built knowing the steps per epoch (``Task.configure_lr_scheduler(optimizer,
plan)``, after the train input); intervals in epochs (``trainer.checkpoint_interval: 1ep``); the
progress line's total and ETA with ``max_epochs`` over an input with a length."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Controller
from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.summaries import progress
from cadence.torch import Context, Task, build_runners

BATCHES, BATCH, LR = 6, 2, 0.1  # 6 batches per epoch


def dataset() -> TensorDataset:
    x = torch.randn(BATCHES * BATCH, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


class EpochTask(Task):
    """A regression on a 6-batch DataLoader; ``schedule``: what configure_lr_scheduler returns
    (``"epoch"``: StepLR(1, 0.5) per epoch, every ``frequency``-th; ``"step"``: per ``frequency``-th step;
    ``"plain"``: a bare StepLR). Records the build order and the plan it was given."""

    def __init__(self, schedule: str = "epoch", frequency: int = 1, generator: bool = False) -> None:
        super().__init__()
        self.schedule, self.frequency, self.generator = schedule, frequency, generator
        self.calls: list[str] = []
        self.plan: Any = None

    def build_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.calls.append("optimizer")
        return torch.optim.SGD(model.parameters(), lr=LR)

    def configure_lr_scheduler(self, optimizer, plan):
        from cadence.torch import LRSchedule

        self.calls.append("scheduler")
        self.plan = plan
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if self.schedule == "none":  # the config's trainer.lr_schedule
            return None
        if self.schedule == "plain":
            return scheduler
        return LRSchedule(scheduler, interval=self.schedule, frequency=self.frequency)

    def build_inputs(self, split: str, ctx: Context) -> Any:
        self.calls.append(f"inputs:{split}")
        loader = DataLoader(dataset(), batch_size=BATCH)
        return iter(loader) if self.generator else loader

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        return {"loss": self.train_step(model, batch)}


def trainer_for(task: EpochTask, **kwargs: Any):
    trainer, _ = build_runners(task, Context.create(device="cpu", seed=0), evaluate=False, **kwargs)
    return trainer


def rates(trainer, steps: int) -> list[float]:
    """The learning rate each of ``steps`` steps trained at (one step per loop)."""
    return [trainer.train(1)["learning_rate"] for _ in range(steps)]


# -- item 5: the scheduler per epoch, built knowing the plan ----------------------------------------


def test_an_epoch_scheduler_steps_when_each_epoch_ends():
    trainer = trainer_for(EpochTask(), max_epochs=3)
    assert rates(trainer, 18) == [LR] * 6 + [LR / 2] * 6 + [LR / 4] * 6  # StepLR(step_size=1): per epoch, not per step
    assert trainer.train(1)["learning_rate"] == LR / 4 and trainer.training_ended  # the data ended: no 4th epoch


def test_the_frequency_counts_epochs_or_steps_and_a_bare_scheduler_steps_per_step():
    assert rates(trainer_for(EpochTask(frequency=2)), 24) == [LR] * 12 + [LR / 2] * 12
    assert rates(trainer_for(EpochTask("step", frequency=3)), 7) == [LR] * 3 + [LR / 2] * 3 + [LR / 4]
    assert rates(trainer_for(EpochTask("plain")), 3) == [LR, LR / 2, LR / 4]


def test_an_epoch_with_accumulation_is_its_batches_over_the_group():
    trainer = trainer_for(EpochTask(), grad_accum_steps=2)  # 3 steps per epoch
    assert rates(trainer, 7) == [LR] * 3 + [LR / 2] * 3 + [LR / 4]


def test_the_scheduler_is_built_after_the_train_input_with_the_plan():
    task = EpochTask()
    trainer = trainer_for(task, grad_accum_steps=2, max_epochs=5, train_steps=12)
    assert task.calls == ["optimizer", "inputs:train", "scheduler"]
    plan = task.plan
    assert (plan.batches_per_epoch, plan.steps_per_epoch, plan.max_epochs, plan.total_steps) == (6, 3, 5, 12)
    assert trainer.planned_steps == 15  # 5 epochs of 3 steps (train_steps is the controller's)
    unsized = EpochTask(generator=True)
    trainer_for(unsized, max_epochs=2)
    assert (unsized.plan.steps_per_epoch, unsized.plan.total_steps) == (None, None)


def test_a_plan_rounds_an_epoch_of_groups_down_and_takes_the_earlier_end():
    from cadence.torch import TrainingPlan

    assert TrainingPlan(7, 2, max_epochs=3).steps_per_epoch == 3
    assert TrainingPlan(7, 2, max_epochs=3).total_steps == 10  # 21 batches: 10 groups (the last one dropped)
    assert TrainingPlan(7, 1, max_epochs=3, train_steps=5).total_steps == 5
    assert TrainingPlan(None, train_steps=5).total_steps == 5 and TrainingPlan(None).total_steps is None


def test_an_epoch_scheduler_over_a_one_shot_iterator_is_one_line():
    trainer = trainer_for(EpochTask(generator=True))
    iterator = r"the train data \(_SingleProcessDataLoaderIter\) never ends an epoch"  # iter(a DataLoader)
    with pytest.raises(ConfigError, match=rf"stepped per epoch, but {iterator}"):
        trainer.train(1)


@pytest.mark.parametrize("interval, frequency", [("epochs", 1), ("epoch", 0)])
def test_a_bad_lr_schedule_is_refused(interval, frequency):
    from cadence.torch import LRSchedule

    with pytest.raises(ValueError, match="LRSchedule"):
        LRSchedule(object(), interval=interval, frequency=frequency)  # type: ignore[arg-type]


# -- item 6: intervals in epochs -----------------------------------------------------------------------


def trainer_config(**trainer: Any):
    return config_from_dict({"task": {"class": "x.py:T"}, "trainer": trainer}).trainer


@pytest.mark.parametrize("given, parsed", [(5, 5), ("1ep", "1ep"), ("2 EP", "2ep"), (" 10ep ", "10ep"), (None, None)])
def test_intervals_parse_as_steps_or_epochs(given, parsed):
    t = trainer_config(checkpoint_interval=given, validation_interval=given)
    assert (t.checkpoint_interval, t.validation_interval) == (parsed, parsed)


@pytest.mark.parametrize("bad", ["0ep", "ep", "1.5ep", "2 epochs", "-1ep", 0, -3, True, 2.0, "100"])
@pytest.mark.parametrize("field", ["checkpoint_interval", "validation_interval"])
def test_a_bad_interval_is_one_line_naming_the_field(field, bad):
    with pytest.raises(ConfigError) as info:
        trainer_config(**{field: bad})
    message = str(info.value)
    assert f"trainer.{field}: expected an integer >= 1 (steps) or '<n>ep'" in message and "\n" not in message


def test_intervals_in_epochs_convert_to_steps():
    from cadence.config.intervals import interval_steps

    assert interval_steps("f", "2ep", batches_per_epoch=10) == 20
    assert interval_steps("f", "1ep", batches_per_epoch=10, grad_accum_steps=5) == 2
    assert interval_steps("f", 7, batches_per_epoch=None) == 7 and interval_steps("f", None, batches_per_epoch=None) is None
    no_length = r"^trainer.validation_interval is '1ep' \(in epochs\), but the train data has no length"
    with pytest.raises(ConfigError, match=no_length):
        interval_steps("trainer.validation_interval", "1ep", batches_per_epoch=None)
    with pytest.raises(ConfigError, match=r"an epoch's 10 batches are not a whole number of optimizer steps of "
                                          r"trainer.grad_accum_steps \(3\)"):
        interval_steps("f", "1ep", batches_per_epoch=10, grad_accum_steps=3)


def test_a_checkpoint_interval_in_epochs_cuts_the_loops_at_the_epochs_ends():
    from cadence.torch.experiments.intervals import resolve_intervals

    t = trainer_config(steps_per_loop=4, checkpoint_interval="1ep", validation_interval="2ep")
    resolved = resolve_intervals(t, batches_per_epoch=10)
    assert (resolved.checkpoint, resolved.validation) == (10, 20)
    per_loop = resolved.steps_per_loop
    assert callable(per_loop)
    assert [per_loop(step) for step in (0, 4, 8, 10, 18, 20)] == [4, 4, 2, 4, 2, 4]  # loops end at 10, 20, ...
    assert resolve_intervals(trainer_config(steps_per_loop=5, checkpoint_interval="1ep"), 10).steps_per_loop == 5
    assert resolve_intervals(trainer_config(steps_per_loop=4, checkpoint_interval=10), 10).steps_per_loop == 4


# -- item 7: the progress line's total with max_epochs ------------------------------------------------


class PlannedTrainer:
    """A trainer whose data ends after ``planned_steps`` steps, each loop taking 10 s of the fake clock."""

    def __init__(self, clock: list[float], planned: int) -> None:
        self.global_step, self.clock, self.planned_steps, self.training_ended = 0, clock, planned, False

    def train(self, num_steps: int) -> dict[str, float]:
        steps = min(num_steps, self.planned_steps - self.global_step)
        self.global_step += steps
        self.training_ended = self.global_step >= self.planned_steps
        self.clock[0] += 10
        return {"loss": 0.5}


def test_the_progress_line_shows_the_planned_total_and_eta(monkeypatch, capsys):
    clock = [1000.0]
    monkeypatch.setattr(progress, "_monotonic", lambda: clock[0])
    controller = Controller(trainer=PlannedTrainer(clock, 6), steps_per_loop=2, progress=True)
    controller.train(None)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]  # not a warning's
    assert lines[0].startswith("step 2/6 (33%)  ") and "eta 0:00:" in lines[0], lines
    assert lines[-1].startswith("step 6/6 (100%)  ") and "elapsed 0:00:30" in lines[-1], lines


def test_a_torch_trainer_plans_its_epochs_for_the_progress_line(monkeypatch, capsys):
    trainer = trainer_for(EpochTask(), max_epochs=2)
    assert trainer.planned_steps == 12
    Controller(trainer=trainer, steps_per_loop=4, progress=True).train(None)
    assert capsys.readouterr().err.splitlines()[-1].startswith("step 12/12 (100%)")
    assert trainer_for(EpochTask()).planned_steps is None  # no max_epochs: no end but train_steps


def test_a_rollback_keeps_an_epoch_scheduler_with_the_data():
    from in_memory import save

    trainer = trainer_for(EpochTask())
    trainer.train(4)
    reader, state = save(trainer)  # in epoch 0
    assert trainer.train(4)["learning_rate"] == LR / 2  # steps 5-8: epoch 1 started at step 7
    trainer.load_checkpoint(reader, state, restore_data=False, restore_rng=False)  # NaN recovery's rollback
    assert trainer.global_step == 4 and trainer.train(1)["learning_rate"] == LR / 2  # epoch 1's rate, not epoch 0's


def test_the_configs_schedule_decays_over_max_epochs_steps_without_train_steps():
    from cadence.torch.experiments.runners import build_runners_from_config

    def built(params: dict[str, Any] | None = None, lr: dict[str, Any] | None = None, **trainer: Any):
        data = {"task": {"class": f"{__file__}:EpochTask", "params": {"schedule": "none", **(params or {})}},
                "trainer": {"train_steps": None, "max_epochs": 2, "device": "cpu", **trainer,
                            "lr_schedule": {"kind": "warmup_linear", "warmup_steps": 2, **(lr or {})}}}
        return build_runners_from_config(config_from_dict(data), train=True, evaluate=False)[2]

    trained = rates(built(), 12)  # 2 epochs of 6 steps: warmup to step 2, then down to 0 at step 12
    assert trained[1] == LR and trained[-2] == pytest.approx(LR * 0.1) and trained[-1] == 0.0
    with pytest.raises(ConfigError, match=r"decays over trainer.max_epochs' steps \(train_steps is null\), but the "
                                          r"train data has no length"):
        built(params={"generator": True})
    with pytest.raises(ConfigError, match=r"max_epochs' steps \(train_steps is null\): 12, fewer than "
                                          r"trainer.lr_schedule.warmup_steps \(20\)"):
        built(lr={"warmup_steps": 20})
    with pytest.raises(ConfigError, match="which is null, as is trainer.max_epochs: set trainer.train_steps, "
                                          "trainer.max_epochs or trainer.lr_schedule.decay_steps"):
        built(max_epochs=None)


def test_an_endless_resumable_loader_ends_no_epoch_so_no_epoch_scheduler_nor_planned_total():
    from cadence.torch import ResumableLoader

    class Endless(EpochTask):
        def build_inputs(self, split: str, ctx: Context) -> Any:
            return ResumableLoader(dataset(), BATCH, seed=ctx.seed)  # epochs=None: one iteration, forever

    trainer = trainer_for(Endless(), max_epochs=2)
    assert trainer.plan().steps_per_epoch == BATCHES and trainer.planned_steps is None  # intervals in epochs still convert
    with pytest.raises(ConfigError, match=r"never ends an epoch \(a one-shot iterator, or a ResumableLoader with epochs=None\)"):
        trainer.train(1)
