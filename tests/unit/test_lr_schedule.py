"""``trainer.lr_schedule``: the warmup + cosine (linear, constant) curves, nanoGPT's and Hugging
Face's recipes step for step, their config errors, the precedence of a Task's own scheduler, the
logged rate, and an exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cadence.config import config_from_dict
from cadence.config.components.lr_schedule import LRScheduleConfig
from cadence.errors import ConfigError
from cadence.summaries.metrics_file import read_metrics
from cadence.torch import build_run, run_training
from cadence.torch.components.lr_schedule import build_lr_schedule, lr_factor

TASKS = Path(__file__).parents[1] / "tasks.py"
BASE_LR = 1e-2  # TinyTask's Adam


def config(model_dir: Path, task: str = "NoSchedulerTask", **trainer):
    schedule = {"kind": "warmup_cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
    data = {"model_dir": str(model_dir), "task": {"class": f"{TASKS}:{task}"},
            "trainer": {"train_steps": 10, "steps_per_loop": 1, "checkpoint_interval": 3, "validation_interval": None,
                        "sanity_val_steps": 0, "seed": 0, "lr_schedule": schedule, **trainer}}
    return config_from_dict(data)


def test_the_curves_at_a_few_steps():
    cosine = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 10, "min_lr_ratio": 0.1}
    # warmup: step k of 2 trains at k/2; then half a cosine from 1 (step 2) to 0.1 (step 10), flat after
    assert [lr_factor(k, **cosine) for k in (1, 2)] == [0.5, 1.0]
    assert lr_factor(6, **cosine) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert lr_factor(3, **cosine) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 8)))
    assert lr_factor(10, **cosine) == pytest.approx(0.1) and lr_factor(25, **cosine) == pytest.approx(0.1)
    linear = {**cosine, "kind": "warmup_linear", "min_lr_ratio": 0.0}
    assert [lr_factor(k, **linear) for k in (1, 2, 6, 10, 11)] == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0])
    constant = {**cosine, "kind": "warmup_constant"}
    assert [lr_factor(k, **constant) for k in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(1, **{**cosine, "warmup_steps": 0}) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 10)))

    # the LambdaLR: optimizer step k (1-based) runs at lr_factor(k)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=2.0)
    scheduler = build_lr_schedule(optimizer, LRScheduleConfig(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.1),
                                  total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * lr_factor(k, **cosine) for k in range(1, 11)])


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py ``get_lr`` (iteration ``it`` is 0-based), written out."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def hf_factor(current_step, kind, num_warmup_steps, num_training_steps, min_lr_rate=0.0):
    """transformers' ``get_{cosine_with_min_lr,linear,constant}_schedule_with_warmup`` lambdas (the
    scheduler's step count, 0-based), written out."""
    if current_step < num_warmup_steps:
        return current_step / max(1, num_warmup_steps)
    if kind == "warmup_constant":
        return 1.0
    progress = (current_step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    if kind == "warmup_linear":
        return max(0.0, (num_training_steps - current_step) / max(1, num_training_steps - num_warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)) * (1 - min_lr_rate) + min_lr_rate


def rates(optimizer, scheduler, steps):
    """The learning rate of each param group that optimizer steps 1..steps train at."""
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def test_nanogpts_recipe_step_for_step():
    # nanoGPT: warmup_iters 5, cosine to min_lr (absolute) at lr_decay_iters 20, held after; 30 steps
    w = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [w.weight]}, {"params": [w.bias], "lr": 1e-3}], lr=6e-4)
    schedule = LRScheduleConfig(kind="warmup_cosine", warmup_steps=5, decay_steps=20, min_lr=6e-5, convention="nanogpt")
    seen = rates(optimizer, build_lr_schedule(optimizer, schedule, total_steps=30), 30)
    for it, (weight_lr, bias_lr) in enumerate(seen):  # optimizer step it + 1 is nanoGPT's iteration it
        assert weight_lr == pytest.approx(nanogpt_get_lr(it, 6e-4, 5, 20, 6e-5), rel=1e-12, abs=0)
        assert bias_lr == pytest.approx(nanogpt_get_lr(it, 1e-3, 5, 20, 6e-5), rel=1e-12, abs=0)
    assert seen[0][0] == pytest.approx(6e-4 / 6) and seen[20][0] == seen[29][0] == pytest.approx(6e-5)


@pytest.mark.parametrize("kind, min_lr_ratio", [("warmup_cosine", 0.0), ("warmup_cosine", 0.1),
                                                ("warmup_linear", 0.0), ("warmup_constant", 0.0)])
def test_hugging_faces_schedules_step_for_step(kind, min_lr_ratio):
    # transformers over num_training_steps = train_steps = 12 with 3 warmup steps: step 1 trains at 0
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    schedule = LRScheduleConfig(kind=kind, warmup_steps=3, min_lr_ratio=min_lr_ratio, convention="huggingface")
    seen = rates(optimizer, build_lr_schedule(optimizer, schedule, total_steps=12), 12)
    assert [lr for (lr,) in seen] == pytest.approx(
        [0.5 * hf_factor(s, kind, 3, 12, min_lr_ratio) for s in range(12)], rel=1e-12, abs=1e-15)
    assert seen[0] == [0.0]


def test_a_decay_horizon_before_the_last_step_holds_the_minimum():
    curve = {"kind": "warmup_linear", "warmup_steps": 2, "decay_steps": 6, "min_lr_ratio": 0.2}
    assert [lr_factor(k, **curve) for k in range(1, 10)] == pytest.approx([0.5, 1, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2, 0.2])


@pytest.mark.parametrize("trainer, message", [
    ({"train_steps": None}, "trainer.lr_schedule (warmup_cosine) decays over trainer.train_steps, which is null"),
    ({"train_steps": 1}, "trainer.lr_schedule.warmup_steps (2) is more than trainer.train_steps (1)"),
    ({"lr_schedule": {"kind": "cosine"}}, "trainer.lr_schedule.kind"),
    ({"lr_schedule": {"kind": "warmup_cosine", "min_lr_ratio": 2}}, "trainer.lr_schedule.min_lr_ratio"),
    ({"lr_schedule": {"kind": "warmup_cosine", "min_lr_ratio": 0.1, "min_lr": 1e-4}},
     "min_lr and min_lr_ratio are both set: give one"),
    ({"lr_schedule": {"kind": "warmup_cosine", "warmup_steps": 5, "decay_steps": 4}},
     "warmup_steps (5) is more than decay_steps (4)"),
])
def test_config_errors(tmp_path, trainer, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path / "run", **trainer)


def test_a_decay_horizon_needs_no_train_steps_and_min_lr_at_most_the_rate(tmp_path):
    schedule = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 8}
    assert config(tmp_path / "run", train_steps=None, lr_schedule=schedule).trainer.lr_schedule.decay_steps == 8
    with pytest.raises(ConfigError, match=r"trainer.lr_schedule.min_lr \(0.5\) is above the optimizer's learning rate"):
        build_run(config(tmp_path / "run", lr_schedule={"kind": "warmup_cosine", "min_lr": 0.5}))


def test_a_task_scheduler_and_the_config_schedule_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.lr_schedule is set, and TinyTask.build_lr_scheduler\(\) "
                                          r"returns a StepLR too: remove one of them"):
        build_run(config(tmp_path / "run", task="TinyTask"))


def test_the_run_follows_the_curve_and_resumes_exactly(tmp_path):
    whole = tmp_path / "whole"
    run_training(config(whole), progress=False)
    logged = {r["step"]: r["learning_rate"] for r in read_metrics(str(whole / "train"))}
    # logged at step s: the rate step s trained at
    cosine = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 10, "min_lr_ratio": 0.1}
    assert logged == pytest.approx({s: BASE_LR * lr_factor(s, **cosine) for s in range(1, 11)})
    assert logged[1] == pytest.approx(BASE_LR / 2) and logged[6] == pytest.approx(BASE_LR * 0.55)

    # stopped at step 4 (checkpoint 3 and 4 committed), resumed in a new run: the same weights, bit for bit
    parted = tmp_path / "parted"
    cfg = config(parted)
    with build_run(cfg, progress=False) as run, run.controller as controller:
        controller.train(4)
    run_training(config(parted), progress=False)
    resumed = {r["step"]: r["learning_rate"] for r in read_metrics(str(parted / "train"))}
    assert resumed == logged
    final = "checkpoints/ckpt-10/model.safetensors"
    a, b = load_file(whole / final), load_file(parted / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
