"""A weight-tied GPT ported as a user ports one (tests/gpt_tasks.py), through the CLI: the smoke test,
training with two named evaluation splits and an evaluation at step 0, the best checkpoint on
``val/loss``, an exact resume after kill -9, the sidecar's metrics, and a plain
``load_state_dict(load_file(...))`` of its export (issue 27's "done when")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from cli_run import popen, run_cadence, run_python
from configs import write_config

cadence = partial(run_cadence, check=True)
STEPS = 40
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """The GPT trained once, uninterrupted: (its config, its model dir)."""
    tmp = tmp_path_factory.mktemp("gpt")
    config = gpt_config(tmp)
    cadence("train", str(config), "--model-dir", str(tmp / "run"))
    return config, tmp / "run"


def test_the_smoke_test_passes_with_no_warning(tmp_path):
    proc = cadence("smoke", str(gpt_config(tmp_path)))
    assert "WARNING" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_it_evaluates_both_splits_from_step_0_and_keeps_the_best_on_val_loss(trained):
    _, run = trained
    evals = records(run / "eval" / "metrics.jsonl")
    assert sorted(evals) == [0, 10, 20, 30, 40]
    for record in evals.values():
        assert {"train/loss", "val/loss"} <= set(record), record
    assert evals[40]["val/loss"] < evals[0]["val/loss"]  # it learned
    assert (run / "eval" / "train").is_dir() and (run / "eval" / "val").is_dir()  # a TensorBoard dir each
    best = json.loads((run / "best" / "best.json").read_text())
    trained_steps = {s: r["val/loss"] for s, r in evals.items() if s > 0}
    assert best["step"] == min(trained_steps, key=trained_steps.get)
    assert best["value"] == pytest.approx(trained_steps[best["step"]])


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


def test_the_sidecars_metrics_equal_the_in_process_ones(trained):
    config, run = trained
    cadence("evaluate", str(config), "--model-dir", str(run), "--continuous", "--name", "sidecar", "--timeout", "30")
    in_process = records(run / "eval" / "metrics.jsonl")
    sidecar = records(run / "eval_sidecar" / "evaluations.jsonl")
    assert sorted(sidecar) == [10, 20, 30, 40]
    for step, record in sidecar.items():
        assert record["status"] == "evaluated"
        assert record["metrics"]["val"]["loss"] == pytest.approx(in_process[step]["val/loss"], rel=1e-6)
        assert record["metrics"]["train"]["loss"] == pytest.approx(in_process[step]["train/loss"], rel=1e-6)


def test_a_plain_load_state_dict_of_its_export_gives_the_logits_cadence_evaluated(trained):
    """The exported best checkpoint, loaded as a user loads a state dict, scores the validation loss
    that cadence recorded for that checkpoint."""
    _, run = trained
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
