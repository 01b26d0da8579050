"""TorchTrainer / TorchEvaluator / build_runners, with an in-memory checkpoint writer/reader."""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence.errors import CheckpointError, UnsafeCheckpointError
from cadence.checkpoint.files import MemoryWriter
from cadence.torch import (
    Context,
    ResumableLoader,
    Task,
    TorchEvaluator,
    TorchTrainer,
    build_runners,
    resolve_precision,
)
from cadence.torch.runtime.rng import seed_everything
from in_memory import MemReader, save

# -- a small regression task ---------------------------------------------------------------------


def regression_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class Regression(Task):
    """Params: n, batch_size, epochs, dropout, lr, optimizer ("adamw" | "sgd"), noisy (use all RNGs)."""

    def p(self, key: str, default: Any) -> Any:
        return self.params.get(key, default)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(self.p("dropout", 0.2)), nn.Linear(32, 1))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.p("optimizer", "adamw") == "sgd":
            return torch.optim.SGD(model.parameters(), lr=self.p("lr", 0.05))
        return torch.optim.AdamW(model.parameters(), lr=self.p("lr", 0.01))

    def build_lr_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)

    def build_inputs(self, split: str, ctx: Context):
        train = split == "train"
        return ResumableLoader(
            regression_data(self.p("n", 64) if train else self.p("n_val", 50), seed=0 if train else 1),
            self.p("batch_size", 16) if train else self.p("val_batch_size", 16),
            shuffle=train and self.p("shuffle", True),
            seed=ctx.seed,
            epochs=self.p("epochs", None) if train else 1,
        )

    def train_step(self, model: nn.Module, batch):
        x, y = batch
        if self.p("noisy", False):  # randomness from every global RNG
            x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * random.random()
        pred = model(x)
        return {"loss": nn.functional.mse_loss(pred, y), "mae": (pred - y).abs().mean(), "const": 2.0}

    def validation_step(self, model: nn.Module, batch):
        x, y = batch
        # draw from every global RNG: the evaluator must put them back
        torch.rand(1), np.random.rand(), random.random()
        return {"loss": nn.functional.mse_loss(model(x), y)}


def make(task: Task, seed: int = 0, **kw) -> tuple[TorchTrainer, TorchEvaluator]:
    seed_everything(seed)
    trainer, evaluator = build_runners(task, Context.create("cpu", seed=0), **kw)
    assert trainer is not None and evaluator is not None
    return trainer, evaluator


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- training ------------------------------------------------------------------------------------


def test_learns_and_counts_steps():
    trainer, _ = make(Regression(dropout=0.0, n=256))
    first = trainer.train(5)
    assert trainer.global_step == 5
    assert set(first) == {"loss", "mae", "const", "learning_rate"} and first["const"] == 2.0
    for _ in range(6):
        last = trainer.train(25)
    assert trainer.global_step == 155
    assert last["loss"] < 0.2 * first["loss"]
    assert last["learning_rate"] == pytest.approx(0.01 * 0.9 ** (155 // 3))
    assert trainer.train(0) == {"learning_rate": last["learning_rate"]}


def test_returned_loss_is_the_mean_over_the_loop():
    task = Regression(dropout=0.0, shuffle=False, optimizer="sgd", lr=0.0)  # lr 0: the loss never changes
    trainer, _ = make(task)
    batches = itertools.islice(task.build_inputs("train", trainer.ctx), 4)
    per_batch = [nn.functional.mse_loss(trainer.model(x), y).item() for x, y in batches]
    logs = trainer.train(4)
    assert logs["loss"] == pytest.approx(sum(per_batch) / 4, rel=1e-6)


def test_grad_accumulation_matches_larger_batch():
    def run(batch_size: int, k: int) -> list[torch.Tensor]:
        trainer, _ = make(Regression(dropout=0.0, optimizer="sgd", lr=0.1, shuffle=False, batch_size=batch_size),
                          grad_accum_steps=k)
        trainer.train(6)
        assert trainer.global_step == 6
        return params(trainer.model)

    for a, b in zip(run(8, 2), run(16, 1)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_grad_clipping_caps_the_update():
    def update(clip: float | None) -> float:
        trainer, _ = make(Regression(dropout=0.0, optimizer="sgd", lr=1.0), grad_clip_norm=clip)
        trainer.lr_scheduler = None
        before = params(trainer.model)
        trainer.train(1)
        return torch.cat([(a - b).flatten() for a, b in zip(params(trainer.model), before)]).norm().item()

    assert update(None) > 0.1
    assert update(0.01) == pytest.approx(0.01, rel=1e-4)


def test_lr_scheduler_steps_per_optimizer_step():
    class Halving(Regression):
        def build_lr_scheduler(self, optimizer):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    trainer, _ = make(Halving(lr=0.8), grad_accum_steps=2)
    logs = trainer.train(3)
    assert logs["learning_rate"] == pytest.approx(0.8 * 0.5**2)  # the rate step 3 trained at
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.8 * 0.5**3)  # step 4's


def test_exhausted_data_returns_fewer_steps_and_drops_partial_group():
    # 5 batches: 2 steps; one epoch (a re-iterable input runs out at max_epochs)
    trainer, _ = make(Regression(n=40, batch_size=8, epochs=1), grad_accum_steps=2, max_epochs=1)
    logs = trainer.train(10)
    assert trainer.global_step == 2 and "loss" in logs and trainer.training_ended
    assert all(p.grad is None for p in trainer.model.parameters())  # the dangling batch was not stepped
    assert "loss" not in trainer.train(10) and trainer.global_step == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu(precision):
    try:
        resolve_precision(precision, "cpu")
    except RuntimeError as e:  # a build without CPU support must say so clearly
        assert precision in str(e)
        return
    trainer, evaluator = make(Regression(dropout=0.0, n=256), precision=precision)
    assert (trainer.grad_scaler is not None) == (precision == "fp16")
    first = trainer.train(10)["loss"]
    last = trainer.train(60)["loss"]
    assert np.isfinite(last) and last < first
    assert np.isfinite(evaluator.evaluate()["loss"])
    reader, state = save(trainer)
    other, _ = make(Regression(dropout=0.0, n=256), seed=3, precision=precision)
    other.load_checkpoint(reader, state)
    if precision == "fp16":
        assert other.grad_scaler.state_dict() == trainer.grad_scaler.state_dict()


def test_precision_errors_are_clear():
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", "cpu")
    with pytest.raises(RuntimeError, match="precision 'fp16'.*'meta'"):
        resolve_precision("fp16", "meta")


def test_bad_train_step_output():
    class Bad(Regression):
        def train_step(self, model, batch):
            return {"mae": 1.0}

    trainer, _ = make(Bad())
    with pytest.raises(TypeError, match="loss"):
        trainer.train(1)


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
@pytest.mark.parametrize(("loss_of", "message"), [
    (lambda pred, y: (pred - y) ** 2, r"Unreduced.train_step returned a loss of shape \(16, 1\); expected a scalar "
                                     r"tensor \(reduce it, e\.g\. loss\.mean\(\)\)"),
    (lambda pred, y: float(((pred - y) ** 2).mean().detach()), r"Unreduced.train_step must return a loss tensor or a "
                                                      r"dict with 'loss', got float"),
    (lambda pred, y: {"loss": 0.5}, r"Unreduced.train_step returned a loss of type float; expected a scalar tensor"),
    (lambda pred, y: ((pred - y) ** 2).mean().detach(), r"Unreduced.train_step returned a loss that does not "
                                                        r"require grad"),
])
def test_a_bad_loss_names_train_step_and_what_is_expected(loss_of, message, grad_accum_steps):
    """Issue 12: not torch's 'grad can be implicitly created only for scalar outputs'."""
    class Unreduced(Regression):
        def train_step(self, model, batch):
            x, y = batch
            return loss_of(model(x), y)

    trainer, _ = make(Unreduced(), grad_accum_steps=grad_accum_steps)
    with pytest.raises(TypeError, match=f"^{message}"):
        trainer.train(1)


# -- exact resume ------------------------------------------------------------------------------


def resume_task() -> Regression:
    return Regression(dropout=0.3, noisy=True, n=72, batch_size=16)  # shuffled, 5 batches/epoch (last short)


@pytest.mark.parametrize("k", [1, 2])
def test_resume_is_bit_identical(k):
    reference, _ = make(resume_task(), grad_accum_steps=k)
    reference.train(4)
    reference.train(7)

    trainer, evaluator = make(resume_task(), grad_accum_steps=k)
    trainer.train(4)
    evaluator.evaluate()  # evaluations anywhere must not change training
    reader, state = save(trainer)
    trainer.train(3)  # the "crashed" run's progress past the checkpoint is lost

    resumed, evaluator2 = make(resume_task(), seed=99, grad_accum_steps=k)  # different init and RNG
    resumed.load_checkpoint(reader, state)
    assert resumed.global_step == 4
    evaluator2.evaluate(2)
    resumed.train(2)
    evaluator2.evaluate()
    resumed.train(5)
    assert resumed.global_step == reference.global_step == 11
    for a, b in zip(params(resumed.model), params(reference.model)):
        assert torch.equal(a, b)
    assert resumed.lr_scheduler.state_dict() == reference.lr_scheduler.state_dict()
    assert resumed.train_data.state_dict() == reference.train_data.state_dict()


def test_rollback_on_a_running_trainer_is_exact():
    trainer, _ = make(resume_task())
    trainer.train(3)
    reader, state = save(trainer)
    trainer.train(4)
    after = params(trainer.model)
    trainer.train(2)
    trainer.load_checkpoint(reader, state)  # e.g. NaN recovery
    trainer.train(4)
    assert all(torch.equal(a, b) for a, b in zip(params(trainer.model), after))


class ListData(Regression):
    """Train data as a plain list of batches: no state_dict, resumed by replay."""

    def build_inputs(self, split, ctx):
        if split != "train":
            return super().build_inputs(split, ctx)
        return list(ResumableLoader(regression_data(64, 0), 16, seed=0, epochs=3))


def test_resume_by_replay_without_state_dict(caplog):
    reference, _ = make(ListData(dropout=0.3))
    reference.train(7)
    trainer, _ = make(ListData(dropout=0.3))
    trainer.train(5)
    reader, state = save(trainer)
    assert state["data"] == {"kind": "replay", "batches": 5}
    resumed, _ = make(ListData(dropout=0.3), seed=5)
    with caplog.at_level(logging.WARNING, logger="cadence.torch.loop.train_data"):
        resumed.load_checkpoint(reader, state)
    assert "replaying 5 batches" in caplog.text
    resumed.train(2)
    assert all(torch.equal(a, b) for a, b in zip(params(resumed.model), params(reference.model)))


def test_checkpoint_before_training_and_files():
    trainer, _ = make(Regression())
    reader, state = save(trainer)
    assert reader.names() == ["model.safetensors", "optimizer.safetensors"]
    assert state["global_step"] == 0 and state["data"] is None
    assert len(state["rng"]) == 1 and set(state["rng"][0]) >= {"python", "numpy", "torch"}  # one per rank
    trainer.train(2)
    _, state = save(trainer)
    assert state["data"] == {"kind": "stateful", "state": {"epoch": 0, "offset": 32}}
    fresh, _ = make(Regression(), seed=1)
    fresh.load_checkpoint(reader, None)
    assert fresh.global_step == 0


def test_unsafe_optimizer_file_is_refused(tmp_path):
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    trainer, _ = make(Regression())
    reader, state = save(trainer)
    buf = io.BytesIO()
    torch.save({"optimizer": Evil()}, buf)
    del reader.files["optimizer.safetensors"]  # a checkpoint in the torch.save form
    reader.files["optimizer.pt"] = buf.getvalue()
    with pytest.raises(UnsafeCheckpointError, match=r"mem://ckpt-0/optimizer\.pt.*arbitrary unpickling"):
        make(Regression(), seed=1)[0].load_checkpoint(reader, state)
    assert not marker.exists()


def test_mismatched_model_is_a_checkpoint_error():
    class Wider(Regression):
        def build_model(self):
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    reader, state = save(make(Regression())[0])
    with pytest.raises(CheckpointError, match="unexpected keys: 3.bias, 3.weight"):
        make(Wider())[0].load_checkpoint(reader, state)


def test_initialize_calls_task_with_the_model():
    seen = []

    class Pretrained(Regression):
        def initialize(self, model):
            seen.append(model)

    trainer, _ = make(Pretrained())
    trainer.initialize()
    assert seen == [trainer.model]


# -- evaluation --------------------------------------------------------------------------------


class Mean(Task):
    """Validation data: the numbers 0..n-1 in batches; metrics are simple functions of them."""

    def build_model(self):
        return nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5))

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_inputs(self, split, ctx):
        self.params["built"] = self.params.get("built", 0) + 1
        x = torch.arange(float(self.params["n"]))
        return ResumableLoader(TensorDataset(x), self.params["batch_size"], shuffle=False, epochs=1)

    def train_step(self, model, batch):
        return model(batch[0][:, None]).mean()

    def validation_step(self, model, batch):
        (x,) = batch
        self.params["steps"] = self.params.get("steps", 0) + 1
        return {"mean": x.mean(), "py_mean": float(x.mean()), "square": (x**2).mean(), "values": x}


class Aggregating(Mean):
    def aggregate_logs(self, state, step_outputs):
        return (state or []) + [step_outputs["values"]]

    def reduce_aggregated_logs(self, aggregated_logs, global_step):
        values = torch.cat(aggregated_logs)
        return {"median": values.median(), "count": len(values), "step": global_step}


def test_weighted_mean_over_uneven_batches_is_exact():
    task = Mean(n=10, batch_size=3)  # batches of 3, 3, 3, 1
    ev = TorchEvaluator(task, task.build_model(), ctx=Context())
    logs = ev.evaluate()
    assert logs == {"mean": pytest.approx(4.5), "py_mean": pytest.approx(4.5), "square": pytest.approx(28.5)}
    assert "values" not in logs
    assert ev.evaluate(-1) == logs and task.params["built"] == 1  # the inputs are built once, re-iterated


def test_aggregate_logs_path():
    task = Aggregating(n=11, batch_size=4)
    trainer, ev = build_runners(task, Context())
    trainer.train(2)
    logs = ev.evaluate()
    assert logs["median"] == 5.0 and logs["count"] == 11 and logs["step"] == 2
    assert logs["mean"] == pytest.approx(5.0)


def test_num_steps_limits_batches():
    task = Mean(n=10, batch_size=3)
    ev = TorchEvaluator(task, task.build_model(), ctx=Context())
    assert ev.evaluate(2)["mean"] == pytest.approx(2.5)
    assert task.params["steps"] == 2
    assert ev.evaluate(2)["mean"] == pytest.approx(2.5)  # starts over each time
    assert ev.evaluate(0) == {}


def test_modes_and_rng_restored():
    task = Mean(n=10, batch_size=3)
    model = nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5), nn.BatchNorm1d(1))
    model.train()
    model[2].eval()  # a frozen submodule stays frozen
    ev = TorchEvaluator(task, model, ctx=Context())
    seed_everything(0)
    expected = (torch.rand(2).tolist(), np.random.rand(), random.random())
    seed_everything(0)
    ev.evaluate()
    assert (torch.rand(2).tolist(), np.random.rand(), random.random()) == expected
    assert [m.training for m in model] == [True, True, False] and model.training
    model.eval()
    ev.evaluate()
    assert not any(m.training for m in model.modules())


def test_evaluator_only_loads_weights():
    trainer, _ = make(Regression())
    trainer.train(3)
    reader, state = save(trainer)
    task = Regression()
    _, ev = build_runners(task, Context(), train=False)
    assert ev is not None
    ev.load_checkpoint(reader, state)
    assert ev.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(params(ev.model), params(trainer.model)))


def test_build_runners_shares_the_model():
    trainer, ev = build_runners(Regression(), Context())
    assert trainer is not None and ev is not None and ev.model is trainer.model
    trainer.train(2)
    assert ev.global_step == 2
    assert build_runners(Regression(), Context(), evaluate=False)[1] is None


def test_build_optimizer_gets_the_task_s_own_model_already_moved_to_the_device():
    class Moved(nn.Linear):  # records the device cadence moves it to
        moved_to: torch.device | None = None

        def to(self, *args, **kwargs):
            self.moved_to = torch.device(args[0] if args else kwargs["device"])
            return super().to(*args, **kwargs)

    seen = []

    class ReadsTheDevice(Regression):
        def build_model(self):
            return Moved(4, 1)

        def build_optimizer(self, model):
            seen.append((model.moved_to, next(model.parameters()).device, type(model)))
            return super().build_optimizer(model)

    ctx = Context.create("cpu", seed=0)
    trainer, _ = build_runners(ReadsTheDevice(), ctx)
    assert seen == [(ctx.device, ctx.device, Moved)] and trainer is not None


def test_task_defaults():
    task = Regression(alpha=1)
    assert task.params == {"alpha": 1}
    assert task.batch_size_of({"x": [torch.zeros(7, 2)], "y": torch.zeros(3)}) == 7
    with pytest.raises(ValueError, match=r"override Task.batch_size_of\(batch\)"):
        task.batch_size_of(["a", "b"])
    assert Mean(n=1, batch_size=1).build_lr_scheduler(None) is None
    assert Mean(n=1, batch_size=1).reduce_aggregated_logs(None, 0) == {}


def test_batch_size_attribute_does_not_shadow_the_weighting():
    class WithParam(Mean):
        def __init__(self, **params):
            super().__init__(**params)
            self.batch_size = params["batch_size"]  # an int attribute, as tasks often have

    task = WithParam(n=10, batch_size=3)
    assert TorchEvaluator(task, task.build_model(), ctx=Context()).evaluate()["mean"] == pytest.approx(4.5)


def test_snapshot_for_an_async_save_is_the_state_at_snapshot_time():
    """An asynchronous save writes what the trainer held when snapshotted, though training went on."""
    trainer, _ = make(Regression(dropout=0.0))
    trainer.train(2)
    expected_reader, expected_state = save(trainer)
    snapshot = trainer.snapshot_checkpoint()
    trainer.train(3)  # training changes weights, optimizer moments, scheduler, data position
    writer = MemoryWriter(2)
    state = json.loads(json.dumps(snapshot.save_checkpoint(writer)))
    assert state["global_step"] == 2 and state["data"] == expected_state["data"]
    assert writer.files["model.safetensors"] == expected_reader.files["model.safetensors"]
    restored, _ = make(Regression(dropout=0.0), seed=1)
    restored.load_checkpoint(MemReader(writer.files, 2), state)
    fresh, _ = make(Regression(dropout=0.0), seed=1)
    fresh.load_checkpoint(expected_reader, expected_state)
    for a, b in zip(params(restored.model), params(fresh.model)):
        assert torch.equal(a, b)
    sa, sb = restored.optimizer.state_dict(), fresh.optimizer.state_dict()
    for index in sa["state"]:
        for key, value in sa["state"][index].items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)
    assert restored.lr_scheduler.state_dict() == fresh.lr_scheduler.state_dict()


def copied(snapshot):
    """``snapshot`` once its pipelined copy is done (its tensors are then the copies)."""
    if snapshot.copied is not None:
        snapshot.copied.result()
    return snapshot


def test_successive_snapshots_reuse_the_written_ones_buffers_and_never_an_unwritten_one():
    trainer, _ = make(Regression(dropout=0.0))
    trainer.train(1)
    first = copied(trainer.snapshot_checkpoint())
    trainer.train(1)
    second = copied(trainer.snapshot_checkpoint())  # the first is not written yet: its tensors are not touched
    first_weight = first.model.tensors["0.weight"]
    assert second.model.tensors["0.weight"].data_ptr() != first_weight.data_ptr()
    expected = MemoryWriter(1)
    first.save_checkpoint(expected)
    assert first.written
    second.save_checkpoint(MemoryWriter(2))
    trainer.train(1)
    third = copied(trainer.snapshot_checkpoint())  # the second was written: its buffers are reused
    assert third.model.tensors["0.weight"].data_ptr() == second.model.tensors["0.weight"].data_ptr()
    moment = third.torch_state["optimizer"]["state"][0]["exp_avg"]
    assert moment.data_ptr() == second.torch_state["optimizer"]["state"][0]["exp_avg"].data_ptr()
    # ... and hold the state of the third snapshot's moment, equal to a fresh save at that step
    writer, fresh = MemoryWriter(3), MemoryWriter(3)
    assert third.save_checkpoint(writer)["global_step"] == 3
    trainer.save_checkpoint(fresh)
    assert writer.files == fresh.files


class FailingWriter(MemoryWriter):
    """Records which thread opens each file; fails the files named in ``fail``."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        super().__init__(0)
        self.fail = fail
        self.threads: dict[str, int] = {}

    def open(self, name):
        import threading

        self.threads[name] = threading.get_ident()
        if name in self.fail:
            raise OSError(f"cannot write {name}")
        return super().open(name)


def test_the_two_files_are_written_at_once_and_the_models_error_wins():
    import threading

    trainer, _ = make(Regression())
    writer = FailingWriter()
    trainer.save_checkpoint(writer)
    assert sorted(writer.files) == ["model.safetensors", "optimizer.safetensors"]
    assert writer.threads["model.safetensors"] == threading.get_ident()
    assert writer.threads["optimizer.safetensors"] != threading.get_ident()  # beside the model's
    with pytest.raises(OSError, match="cannot write optimizer.safetensors"):
        trainer.save_checkpoint(FailingWriter(fail=("optimizer.safetensors",)))
    with pytest.raises(OSError, match="cannot write model.safetensors"):
        trainer.save_checkpoint(FailingWriter(fail=("model.safetensors", "optimizer.safetensors")))
