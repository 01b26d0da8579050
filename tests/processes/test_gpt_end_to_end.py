"""A weight-tied GPT ported as a user ports one (tests/gpt_tasks.py), through the CLI (issue 27's "done
when"): the smoke test; training with two named evaluation splits (``{"train": a sample of the
training data, "val": held-out data}``) from an evaluation at step 0, a TensorBoard directory per
split, the best checkpoint on ``val/loss``; ``cadence ls`` / ``report`` / ``evaluate`` (one process
and two, on uneven shards); the sidecar's metrics; an exact resume after kill -9; and a plain
``load_state_dict(load_file(...))`` of its export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli_run import popen, run_cadence, run_python
from configs import write_config

cadence = partial(run_cadence, check=True)
STEPS = 40
EVALUATED = [0, 10, 20, 30, 40]
TRAINER = {"train_steps": STEPS, "steps_per_loop": 5, "checkpoint_interval": 10, "validation_interval": 10,
           "max_to_keep": None, "seed": 2, "eval_at_start": True,
           "best_checkpoint": {"metric": "val/loss", "higher_is_better": False}}
EXPORT = {"formats": ["safetensors"], "on": "best", "max_to_keep": 1}


def gpt_config(directory: Path, **params) -> Path:
    return write_config(directory, "gpt_tasks.py:TinyGPTTask", params=params, trainer=TRAINER, export=EXPORT)


def records(path: Path) -> dict[int, dict]:
    """metrics.jsonl / evaluations.jsonl by step (the last record of a step wins)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def final_weights(run: Path) -> bytes:
    return (run / "checkpoints" / f"ckpt-{STEPS}" / "model.safetensors").read_bytes()


def nested(record: dict) -> dict:
    """A flat ``metrics.jsonl`` record's ``split/metric`` keys as ``{split: {metric: value}}``."""
    return {split: {"loss": record[f"{split}/loss"]} for split in ("train", "val")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The GPT trained once, uninterrupted: (its config, its model dir, the finished process)."""
    tmp = tmp_path_factory.mktemp("gpt")
    config = gpt_config(tmp)
    proc = cadence("train", str(config), "--model-dir", str(tmp / "run"), "--no-progress")
    return config, tmp / "run", proc


def test_the_smoke_test_passes_with_no_warning_and_shows_both_splits(tmp_path):
    proc = cadence("smoke", str(gpt_config(tmp_path)))
    assert "WARNING" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PASS  evaluate"))
    assert "train/loss=" in line and "val/loss=" in line and "{" not in line


def test_it_evaluates_both_splits_from_step_0_each_in_its_tensorboard_dir_and_keeps_the_best_on_val_loss(trained):
    _, run, proc = trained
    evals = records(run / "eval" / "metrics.jsonl")
    assert sorted(evals) == EVALUATED
    assert evals[40]["val/loss"] < evals[0]["val/loss"]  # it learned
    for split in ("train", "val"):
        acc = EventAccumulator(str(run / "eval" / split))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
            (s, pytest.approx(evals[s][f"{split}/loss"], rel=1e-6)) for s in EVALUATED]
    best = json.loads((run / "best" / "best.json").read_text())
    trained_steps = {s: r["val/loss"] for s, r in evals.items() if s > 0}  # never the untrained weights
    step = min(trained_steps, key=trained_steps.get)
    assert (best["metric"], best["step"], best["value"]) == ("val/loss", step, evals[step]["val/loss"])
    assert best["metrics"] == {k: v for k, v in evals[step].items() if k not in ("step", "time")}
    assert [p.name for p in (run / "best").glob("ckpt-*")] == [f"ckpt-{step}"]
    assert f"val/loss={evals[40]['val/loss']:.4g}" in proc.stderr  # the eval log line
    assert "done: train/loss=" in proc.stderr


def test_ls_and_report_show_the_nested_metrics(trained):
    _, run, _ = trained
    listing = cadence("ls", str(run)).stdout
    header = next(line for line in listing.splitlines() if line.startswith("step"))
    assert header.split()[3:5] == ["val/loss", "train/loss"]
    assert f"{records(run / 'eval' / 'metrics.jsonl')[40]['val/loss']:.4g}" in listing
    cadence("report", str(run))
    assert "val/loss" in (run / "report.html").read_text()


def test_evaluate_prints_the_nested_metrics_on_one_and_two_processes(trained):
    config, run, _ = trained
    expected = nested(records(run / "eval" / "metrics.jsonl")[10])
    one = cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "10")
    single = json.loads(one.stdout)
    assert single.pop("step") == 10 and list(single) == ["train", "val"]
    assert single == {k: {"loss": pytest.approx(v["loss"], rel=1e-9)} for k, v in expected.items()}
    assert "eval at step 10" in one.stderr and "train/loss=" in one.stderr and "val/loss=" in one.stderr
    # 2 ranks, 63 windows in each split: shards of 32 and 31
    two = json.loads(cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "10",
                             "--nproc", "2").stdout)
    assert two.pop("step") == 10
    assert two == {k: {"loss": pytest.approx(v["loss"], rel=1e-6)} for k, v in single.items()}


def test_killed_then_resumed_is_bit_identical(tmp_path, trained):
    config = gpt_config(tmp_path, step_sleep=0.05)
    run = tmp_path / "run"
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(run)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = run / "checkpoints" / "ckpt-20" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a few steps past the checkpoint: lost, and redone exactly
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run / "checkpoints" / f"ckpt-{STEPS}").exists(), "the run finished before it was killed"
    cadence("train", str(config), "--model-dir", str(run), "--set", "task.params.step_sleep=0")
    assert final_weights(run) == final_weights(trained[1])
    evaluated = [json.loads(line)["step"] for line in (run / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert evaluated == EVALUATED  # step 0 once: not again on resume


def test_the_sidecar_records_the_nested_metrics_of_the_in_process_evaluation(trained):
    config, run, _ = trained
    proc = cadence("evaluate", str(config), "--model-dir", str(run), "--continuous", "--name", "side",
                   "--timeout", "60")
    in_process = records(run / "eval" / "metrics.jsonl")
    sidecar = records(run / "eval_side" / "evaluations.jsonl")
    assert sorted(sidecar) == EVALUATED[1:]  # every checkpoint (none at step 0)
    for step, record in sidecar.items():
        assert record["status"] == "evaluated"
        assert record["metrics"] == {k: {"loss": pytest.approx(v["loss"], rel=1e-9)}
                                     for k, v in nested(in_process[step]).items()}
    step = min(sidecar, key=lambda s: in_process[s]["val/loss"])
    assert json.loads(proc.stdout)["best"] == {"metric": "val/loss", "step": step,
                                               "value": pytest.approx(in_process[step]["val/loss"])}
    assert {p.name for p in (run / "eval_side").iterdir() if p.is_dir()} == {"train", "val"}


def test_a_plain_load_state_dict_of_its_export_gives_the_logits_cadence_evaluated(trained):
    """The exported best checkpoint, loaded as a user loads a state dict, scores the validation loss
    that cadence recorded for that checkpoint."""
    _, run, _ = trained
    best = json.loads((run / "best" / "best.json").read_text())
    export = run / "export" / "best" / str(best["step"])
    code = f"""
import sys, torch
from torch.nn import functional as F
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from safetensors.torch import load_file
from gpt_tasks import TinyGPT, TinyGPTTask
model = TinyGPT()
model.load_state_dict(load_file({str(export / 'model.safetensors')!r}))
assert model.lm_head.weight is model.transformer["wte"].weight
x, y = TinyGPTTask().val_set.tensors
model.eval()
with torch.no_grad():
    print(F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item())
"""
    proc = run_python(["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert float(proc.stdout) == pytest.approx(best["value"], rel=1e-5)
