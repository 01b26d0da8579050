"""``trainer.lr_schedule``: the warmup + cosine (linear, constant) curves, their config errors, the
precedence of a Task's own scheduler, and an exact resume."""

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
    cosine = {"kind": "warmup_cosine", "warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.1}
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


@pytest.mark.parametrize("trainer, message", [
    ({"train_steps": None}, "trainer.lr_schedule (warmup_cosine) decays over trainer.train_steps, which is null"),
    ({"train_steps": 1}, "trainer.lr_schedule.warmup_steps (2) is more than trainer.train_steps (1)"),
    ({"lr_schedule": {"kind": "cosine"}}, "trainer.lr_schedule.kind"),
    ({"lr_schedule": {"kind": "warmup_cosine", "min_lr_ratio": 2}}, "trainer.lr_schedule.min_lr_ratio"),
])
def test_config_errors(tmp_path, trainer, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path / "run", **trainer)


def test_a_task_scheduler_and_the_config_schedule_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.lr_schedule is set, and TinyTask.build_lr_scheduler\(\) "
                                          r"returns a StepLR too: remove one of them"):
        build_run(config(tmp_path / "run", task="TinyTask"))


def test_the_run_follows_the_curve_and_resumes_exactly(tmp_path):
    whole = tmp_path / "whole"
    run_training(config(whole), progress=False)
    logged = {r["step"]: r["learning_rate"] for r in read_metrics(str(whole / "train"))}
    # logged after each step: the rate of the next one
    cosine = {"kind": "warmup_cosine", "warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.1}
    assert logged == pytest.approx({s: BASE_LR * lr_factor(s + 1, **cosine) for s in range(1, 11)})
    assert logged[1] == pytest.approx(BASE_LR) and logged[5] == pytest.approx(BASE_LR * 0.55)

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
