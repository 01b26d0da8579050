"""Epochs over a finite train input (issue 27, item 6): a re-iterable input (a plain ``DataLoader``)
that runs out starts its next epoch (``set_epoch`` first), the epoch is in the data position and the
logs, ``max_epochs`` ends training, and a one-shot iterator still ends the run with the old message."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cadence import Controller
from cadence.errors import ConfigError
from cadence.torch import Context, ResumableLoader, Task, build_runners
from cadence.torch.runtime.rng import seed_everything
from in_memory import save

BATCHES, BATCH = 43, 2  # 43 batches per epoch, as in the report


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class RecordingSampler(DistributedSampler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        super().set_epoch(epoch)


class Finite(Task):
    """A tiny regression on a plain DataLoader (params: kind = shuffle | sampler | generator), or on a
    one-pass ResumableLoader (kind = resumable)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))  # dropout: the RNG matters

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01)

    def build_inputs(self, split: str, ctx: Context) -> Any:
        kind = self.params.get("kind", "shuffle")
        if kind == "resumable":
            return ResumableLoader(dataset(), BATCH, seed=ctx.seed, epochs=1)
        if kind == "generator":
            return iter(DataLoader(dataset(), batch_size=BATCH))
        if kind == "sampler":
            self.sampler = RecordingSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=3)
            return DataLoader(dataset(), batch_size=BATCH, sampler=self.sampler)
        return DataLoader(dataset(), batch_size=BATCH, shuffle=True)  # draws its order from the global RNG

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": self.train_step(model, batch)}


def trainer_of(task: Task, seed: int = 0, **kw: Any) -> Any:
    seed_everything(seed)
    trainer, _ = build_runners(task, Context.create("cpu", seed=0), evaluate=False, **kw)
    return trainer


def params(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_plain_dataloader_trains_150_steps_over_4_epochs_and_logs_the_epoch():
    trainer = trainer_of(Finite())
    first = trainer.train(40)
    assert trainer.global_step == 40 and "epoch" not in first  # the first epoch: nothing to say yet
    logs = trainer.train(110)
    assert trainer.global_step == 150 and logs["epoch"] == 3.0  # 150 = 3 * 43 + 21
    assert trainer.prepare_checkpoint() is None and save(trainer)[1]["data"]["epoch"] == 3


def test_accumulation_groups_cross_epochs_too():
    trainer = trainer_of(Finite(), grad_accum_steps=2)
    logs = trainer.train(50)  # 100 batches: 43 + 43 + 14
    assert trainer.global_step == 50 and logs["epoch"] == 2.0 and save(trainer)[1]["data"]["batches"] == 14


def test_set_epoch_is_called_on_a_distributed_sampler_for_each_epoch():
    task = Finite(kind="sampler")
    trainer = trainer_of(task)
    trainer.train(150)
    assert task.sampler.calls == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["shuffle", "sampler", "resumable"])
@pytest.mark.parametrize("at", [50, 86])  # mid-epoch 1; at the end of epoch 1, before epoch 2 starts
def test_resume_in_a_later_epoch_is_exact(kind, at):
    reference = trainer_of(Finite(kind=kind))
    reference.train(at)
    reference.train(130 - at)
    trainer = trainer_of(Finite(kind=kind))
    trainer.train(at)
    reader, state = save(trainer)
    assert state["data"]["epoch"] == 1
    if kind == "resumable":  # its own position counts its passes (set_epoch numbers them)
        assert state["data"]["state"] == ({"epoch": 1, "offset": 14} if at == 50 else {"epoch": 2, "offset": 0})
    else:
        assert state["data"]["batches"] == at - BATCHES
    resumed = trainer_of(Finite(kind=kind), seed=7)  # another RNG before the restore: it must not matter
    resumed.load_checkpoint(reader, state)
    resumed.train(130 - at)
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(reference)))


def test_max_epochs_ends_training_before_train_steps():
    trainer = trainer_of(Finite(), max_epochs=2)
    controller = Controller(trainer=trainer, steps_per_loop=10)
    controller.train(150)  # no "the training data may be exhausted": the epochs are done
    assert trainer.global_step == 2 * BATCHES and trainer.training_ended


def test_max_epochs_alone_ends_training():
    trainer = trainer_of(Finite(), max_epochs=1, ends_with_data=True)
    Controller(trainer=trainer, steps_per_loop=10).train(None)
    assert trainer.global_step == BATCHES


def test_epochs_that_end_at_an_evaluation_step_are_evaluated_there_once():
    seed_everything(0)
    trainer, evaluator = build_runners(Finite(), Context.create("cpu", seed=0), max_epochs=2, ends_with_data=True)
    steps: list[int] = []
    controller = Controller(trainer=trainer, evaluator=evaluator, steps_per_loop=BATCHES,
                            eval_actions=[lambda output: steps.append(trainer.global_step)])
    controller.train_and_evaluate(None, eval_interval=BATCHES)  # the last loop trains no step: the data has ended
    assert steps == [BATCHES, 2 * BATCHES]


def test_neither_train_steps_nor_max_epochs_with_a_re_iterable_input_is_a_config_error():
    trainer = trainer_of(Finite(), ends_with_data=True)
    with pytest.raises(ConfigError, match="trainer.train_steps and trainer.max_epochs are both null"):
        trainer.train(1)


def test_a_generator_still_ends_the_run_with_the_message_of_old():
    trainer = trainer_of(Finite(kind="generator"))
    with pytest.raises(RuntimeError, match="advanced the global step by 3 .from 40 to 43. but 10 steps were "
                                           "requested; the training data may be exhausted"):
        Controller(trainer=trainer, steps_per_loop=10).train(150)
    generator = trainer_of(Finite(kind="generator"), ends_with_data=True)  # train_steps null: its end ends training
    Controller(trainer=generator, steps_per_loop=10).train(None)
    assert generator.global_step == BATCHES


def test_a_finite_resumable_loader_draws_a_new_order_in_each_epoch():
    loader = ResumableLoader(TensorDataset(torch.arange(12)), 4, seed=1, epochs=1)
    first = [b[0].tolist() for b in loader]
    loader.set_epoch(1)
    second = [b[0].tolist() for b in loader]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(12)) and first != second
    again = ResumableLoader(TensorDataset(torch.arange(12)), 4, seed=1, epochs=1)
    again.set_epoch(1)
    again.load_state_dict({"epoch": 1, "offset": 4})
    assert [b[0].tolist() for b in again] == second[1:]
