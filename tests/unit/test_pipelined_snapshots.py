"""Pipelined snapshots (cadence.torch.checkpoint_io.pipelined): an asynchronous save whose tensor copy
runs beside the next step writes the checkpoint a synchronous save at its step writes, bit for bit,
whatever changes the state after the save: BatchNorm's buffers in the forward pass, the optimizer,
the LR scheduler and the grad scaler at the step, the EMA after it, accumulation over micro-batches,
a load, the EMA's swap. The copy is slowed down (each tensor's copy waits first) so that training
reaches those changes while it is still in flight."""

from __future__ import annotations

import inspect
import os
import json
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cadence.checkpoint.files import MemoryWriter
from cadence.config.components.ema import EMAConfig
from cadence.torch import Context, Task, build_runners
from cadence.torch.checkpoint_io import pipelined
from cadence.torch.components.ema import applied
from cadence.torch.runtime.rng import get_rng_state, seed_everything, set_rng_state
from in_memory import MemReader

SLOW_COPY_S = 0.01  # per tensor: a copy of the whole state takes several steps' time


class BatchNormTask(Task):
    """An MLP with BatchNorm (buffers the forward pass changes) and dropout (the RNG), Adam and a
    step LR schedule; a stream of random batches."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=0.01)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def build_inputs(self, split, ctx):
        g = torch.Generator().manual_seed(7)
        return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(64)]

    def train_step(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        return {}


def make_trainer(*, accumulate: int = 1, scaler: bool = False, ema: bool = True):
    seed_everything(0)
    trainer, _ = build_runners(BatchNormTask(), Context.create("cpu", seed=0), evaluate=False,
                               grad_accum_steps=accumulate, ema=EMAConfig(decay=0.9) if ema else None)
    if scaler:  # the fp16 path's scaler (scale, unscale_, step, update), here on float32 CPU tensors
        trainer.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    if trainer.ema is not None:
        ema_callback = trainer.ema
        ema_callback.attached = True
        trainer.set_step_end(lambda step: ema_callback.on_train_step_end(None, step))
    trainer.initialize()
    return Twin(trainer)


class Twin:
    """A trainer with an RNG state of its own (the global RNGs are swapped in around each call), so
    that two trainers built alike draw the same numbers, whatever runs in between."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.rng = get_rng_state()

    def __getattr__(self, name: str):
        value = getattr(self.trainer, name)
        if not inspect.ismethod(value):
            return value

        def call(*args, **kwargs):
            set_rng_state(self.rng)
            try:
                return value(*args, **kwargs)
            finally:
                self.rng = get_rng_state()

        return call

    def __setattr__(self, name: str, value) -> None:
        if name in ("trainer", "rng"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.trainer, name, value)


def one_by_one(monkeypatch) -> None:
    """Make a pipelined snapshot copy its tensors through ``pipelined.copy_tensor``, one by one
    (not in one call: ``copy_tensors``), so that a test can patch each copy."""

    def copy_tensors(sources, into, *, cuda, fitted=False):
        return [pipelined.copy_tensor(t, i if isinstance(i, torch.Tensor) else None) for t, i in zip(sources, into)]

    monkeypatch.setattr(pipelined, "copy_tensors", copy_tensors)


@pytest.fixture
def slow_copies(monkeypatch):
    """Each tensor copy of a pipelined snapshot starts SLOW_COPY_S late (on the copying thread)."""
    copy = pipelined.copy_tensor

    def slow(t, into=None):
        time.sleep(SLOW_COPY_S)
        return copy(t, into)

    one_by_one(monkeypatch)
    monkeypatch.setattr(pipelined, "copy_tensor", slow)


def files_and_state(save) -> tuple[dict[str, bytes], dict]:
    writer = MemoryWriter(0)
    state = json.loads(json.dumps(save(writer)))
    return dict(writer.files), state


CASES = {
    "plain": {},
    "accumulation": {"accumulate": 3},
    "grad-scaler": {"scaler": True},
}


@pytest.mark.parametrize("case", CASES)
def test_a_pipelined_snapshot_writes_what_a_synchronous_save_at_its_step_writes(case, slow_copies):
    options = CASES[case]
    pipelined_trainer, reference = make_trainer(**options), make_trainer(**options)
    pipelined_trainer.train(3)
    reference.train(3)
    snapshot = pipelined_trainer.snapshot_checkpoint()
    assert snapshot.copied is not None  # the copy runs in the background ...
    pipelined_trainer.train(2)  # ... while the model, optimizer, scheduler, scaler and EMA move on
    saved = files_and_state(snapshot.save_checkpoint)
    expected = files_and_state(reference.save_checkpoint)
    assert set(saved[0]) == {"model.safetensors", "optimizer.safetensors", "ema.safetensors"}
    for name in expected[0]:
        assert saved[0][name] == expected[0][name], name
    assert saved[1] == expected[1]  # the step, every RNG state, the data position


def test_without_the_fence_the_next_step_would_change_what_is_copied(monkeypatch):
    """The test above can fail: with the trainer's wait before its optimizer step removed, a copy that
    starts after the next steps reads parameters they have already changed."""
    monkeypatch.setattr(pipelined.StateFence, "wait", lambda self: None)
    trained = threading.Event()
    copy = pipelined.copy_tensor

    def late(t, into=None):
        trained.wait(30)
        return copy(t, into)

    one_by_one(monkeypatch)
    monkeypatch.setattr(pipelined, "copy_tensor", late)
    trainer, reference = make_trainer(ema=False), make_trainer(ema=False)
    trainer.train(3)
    reference.train(3)
    snapshot = trainer.snapshot_checkpoint()
    trainer.train(2)
    trained.set()
    saved, expected = files_and_state(snapshot.save_checkpoint), files_and_state(reference.save_checkpoint)
    assert saved[0]["model.safetensors"] != expected[0]["model.safetensors"]


def test_a_resume_from_a_pipelined_checkpoint_is_bit_identical_to_one_from_a_synchronous_one(slow_copies):
    trainer, reference = make_trainer(), make_trainer()
    trainer.train(3)
    reference.train(3)
    snapshot = trainer.snapshot_checkpoint()
    trainer.train(1)
    files, state = files_and_state(snapshot.save_checkpoint)
    sync_files, sync_state = files_and_state(reference.save_checkpoint)
    resumed, resumed_sync = make_trainer(), make_trainer()
    resumed.load_checkpoint(MemReader(files, 3), state)
    resumed_sync.load_checkpoint(MemReader(sync_files, 3), sync_state)
    resumed.train(4)
    resumed_sync.train(4)
    after, after_sync = files_and_state(resumed.save_checkpoint), files_and_state(resumed_sync.save_checkpoint)
    assert after == after_sync


def test_a_load_and_the_emas_swap_wait_for_the_copy_in_flight(slow_copies):
    trainer, reference = make_trainer(), make_trainer()
    other = make_trainer()
    other.train(5)
    other_files, other_state = files_and_state(other.save_checkpoint)
    trainer.train(2)
    reference.train(2)
    expected = files_and_state(reference.save_checkpoint)
    snapshot = trainer.snapshot_checkpoint()
    with applied(trainer.ema):  # swaps the EMA into the model in place: after the copy
        pass
    trainer.load_checkpoint(MemReader(other_files, 5), other_state)  # replaces every tensor: after the copy
    assert files_and_state(snapshot.save_checkpoint) == expected


def test_the_training_thread_waits_only_before_its_optimizer_step(monkeypatch):
    """The forward and backward passes run while the copy is in flight; the optimizer step after it."""
    events: list[str] = []
    copy = pipelined.copy_tensor
    forward_ran = threading.Event()

    def after_the_forward(t, into=None):  # the copy is held until the next forward has run
        forward_ran.wait(10)
        copied = copy(t, into)
        events.append("copy")
        return copied

    one_by_one(monkeypatch)
    monkeypatch.setattr(pipelined, "copy_tensor", after_the_forward)
    trainer = make_trainer(ema=False)
    trainer.train(2)
    task_step, optimizer_step = trainer.task.train_step, trainer.optimizer.step

    def train_step(model, batch):
        events.append("forward")
        forward_ran.set()
        return task_step(model, batch)

    def step(*args, **kwargs):
        events.append("step")
        return optimizer_step(*args, **kwargs)

    trainer.task.train_step, trainer.optimizer.step = train_step, step
    snapshot = trainer.snapshot_checkpoint()
    assert snapshot.copied is not None
    trainer.train(1)
    copies = events.count("copy")
    assert copies > 0 and events == ["forward"] + ["copy"] * copies + ["step"]
    assert not trainer._checkpoint.fence.active


def test_a_snapshot_with_pipelining_off_copies_everything_before_it_returns():
    trainer = make_trainer()
    trainer.pipelined_snapshots = False
    trainer.train(2)
    snapshot = trainer.snapshot_checkpoint()
    assert snapshot.copied is None
    live = {p.data_ptr() for p in trainer.model.parameters()}
    assert not live & {t.data_ptr() for t in snapshot.model.tensors.values()}


def test_a_failed_copy_fails_the_save_and_its_tensors_are_never_reused(monkeypatch):
    trainer = make_trainer(ema=False)
    trainer.train(2)

    def broken(t, into=None):
        raise MemoryError("no memory for the copy")

    one_by_one(monkeypatch)
    monkeypatch.setattr(pipelined, "copy_tensor", broken)
    snapshot = trainer.snapshot_checkpoint()
    trainer.train(1)  # training goes on: the fence does not raise the copy's failure
    with pytest.raises(MemoryError, match="no memory for the copy"):
        snapshot.save_checkpoint(MemoryWriter(2))
    assert not snapshot.written
    monkeypatch.undo()
    following = trainer.snapshot_checkpoint()
    following.copied.result()
    live = {p.data_ptr() for p in trainer.model.parameters()}
    assert not live & {t.data_ptr() for t in following.model.tensors.values()}


@pytest.mark.parametrize("pipelined_saves", [True, False])
def test_checkpoint_pipelined_in_the_config_reaches_the_trainer(pipelined_saves, tmp_path):
    from pathlib import Path

    from cadence.config import config_from_dict
    from cadence.torch.experiments.runners import build_runners_from_config

    tasks = Path(__file__).parents[1] / "tasks.py"
    cfg = config_from_dict({"task": {"class": f"{tasks}:TinyTask"}, "trainer": {"device": "cpu", "train_steps": 4},
                            "checkpoint": {"pipelined": pipelined_saves}}, model_dir=str(tmp_path))
    _, _, trainer, _ = build_runners_from_config(cfg, train=True, evaluate=False)
    trainer.train(1)
    assert trainer.pipelined_snapshots is pipelined_saves
    assert (trainer.snapshot_checkpoint().copied is not None) is pipelined_saves


@pytest.mark.skipif(not hasattr(os, "getpriority") or not os.path.exists("/proc/self/task"), reason="Linux thread priorities")
def test_a_copy_started_by_a_lowered_writer_thread_still_runs_at_the_training_threads_priority(monkeypatch):
    """The copy starts on whichever thread needs it first, the checkpoint's (lowered) writer thread
    included; the stager's thread, started by the fence on the training thread, keeps that one's
    priority (a thread takes the priority of the thread that starts it)."""
    from cadence.checkpoint.background import Worker, yield_cpu

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    monkeypatch.setattr(pipelined, "_STAGER", Worker("cadence-test-stage", lower_priority=False))
    own, seen = nice(), []
    jobs = pipelined.CopyJobs()
    jobs.then(lambda: seen.append(nice()))
    copy = pipelined.StateFence().start(jobs)  # at the save, on this (the training) thread

    def writer() -> None:
        yield_cpu()
        seen.append(nice())
        copy.queued()  # the writer needs the copy first: it starts it

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen[0] > own and seen[1] == own, seen


def test_the_copy_runs_at_the_training_threads_priority_and_the_writer_below_it():
    """The next optimizer step waits for the copy: its thread is not lowered as the writer threads are."""
    from cadence.checkpoint.background import BACKGROUND_NICE, Worker

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    own = nice()
    copying = pipelined.stage_in_background(nice).result()
    writing = Worker("cadence-test-writer").submit(nice).result()
    assert copying == own and writing == min(19, own + BACKGROUND_NICE)
