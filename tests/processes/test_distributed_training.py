"""Multi-process training through `cadence train --nproc N` (torch's own launcher, gloo on CPU):
the digits example on 2 ranks, a SIGTERM to a non-zero rank, and resuming on another world size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from cadence.summaries.metrics_file import read_metrics
from cli_run import ENV as RUN_ENV, popen
from cli_run import run_cadence
from configs import write_config

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits" / "config.yaml"
TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
ENV = {**RUN_ENV, "COLUMNS": "200"}
cadence = partial(run_cadence, env={"COLUMNS": "200"})  # the CLI runner, 200 columns wide


def final_weights(model_dir: Path, step: int) -> bytes:
    return (model_dir / "checkpoints" / f"ckpt-{step}" / "model.safetensors").read_bytes()


def test_digits_on_two_ranks_trains_evaluates_checkpoints_and_resumes(tmp_path, digits_run):
    single, _ = digits_run  # the same config on one process
    run = tmp_path / "two"
    first = cadence("train", str(DIGITS), "--model-dir", str(run), "--nproc", "2", "--no-progress",
                    "--set", "trainer.train_steps=400")
    assert first.returncode == 0, first.stdout + first.stderr
    second = cadence("train", str(DIGITS), "--model-dir", str(run), "--nproc", "2", "--no-progress")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored checkpoint" in second.stdout + second.stderr
    evals = read_metrics(run / "eval")
    assert [r["step"] for r in evals] == [200, 400, 600]  # one writer (rank 0); resumed, not redone
    one = read_metrics(single / "eval")[-1]["accuracy"]
    two = evals[-1]["accuracy"]
    assert abs(one - two) <= 0.01, (one, two)
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 600
    state = json.loads((run / "checkpoints" / "ckpt-600" / "state.json").read_text())
    assert len(state["state"]["trainer"]["rng"]) == 2  # every rank's RNG state


@pytest.mark.parametrize("task", ["TinyTask", "BatchNormTask"])
def test_sigterm_to_a_non_zero_rank_commits_one_step_on_all_and_resumes_exactly(tmp_path, task):
    """With BatchNorm too: the preemption's save makes rank 0's buffers every rank's at a step the
    uninterrupted run never synced at (a multiple of 4 below 16), and the weights and buffers still end
    bit-identical."""
    config = write_config(tmp_path, task, params={"n": 256},
                          trainer={"checkpoint_interval": 16, "validation_interval": 16})
    straight = tmp_path / "straight"
    proc = cadence("train", str(config), "--model-dir", str(straight), "--nproc", "2", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    run = tmp_path / "run"
    pids = tmp_path / "pids"
    pids.mkdir()
    job = popen(
        ["-m", "cadence", "train", str(config), "--model-dir", str(run), "--nproc", "2",
         "--no-progress", "--set", "task.params.step_sleep=0.1", "--set", f"task.params.pid_dir={pids}",
         "--set", "trainer.checkpoint_interval=null"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )
    deadline = time.monotonic() + 120
    while not (pids / "rank1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = run / "train" / "metrics.jsonl"
    while (not metrics.exists() or not metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(int((pids / "rank1").read_text()), signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-"))
    assert len(steps) == 1 and 0 < steps[0] < 24, steps  # one step, committed once, for all ranks
    assert not (run / "checkpoints" / "FINAL").exists()
    state = json.loads((run / "checkpoints" / f"ckpt-{steps[0]}" / "state.json").read_text())
    assert len(state["state"]["trainer"]["rng"]) == 2

    resumed = cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert final_weights(run, 24) == final_weights(straight, 24)


@pytest.mark.parametrize("nproc", ["1", "3"])
def test_a_two_rank_checkpoint_resumes_on_another_world_size(tmp_path, nproc):
    config = write_config(tmp_path, params={"n": 256})
    run = tmp_path / "run"
    first = cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress",
                    "--set", "trainer.train_steps=8")
    assert first.returncode == 0, first.stdout + first.stderr
    state = json.loads((run / "checkpoints" / "ckpt-8" / "state.json").read_text())["state"]["trainer"]["data"]
    resumed = cadence("train", str(config), "--model-dir", str(run), "--nproc", nproc, "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 24
    # the data position was saved in global samples: 8 steps x 2 ranks x batch 8
    assert state["state"] == {"epoch": 0, "offset": 8 * 2 * 8}
