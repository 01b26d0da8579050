"""Multi-process training through `cadence train --nproc N` (torch's own launcher, gloo on CPU):
the digits example on 2 ranks, a SIGTERM to a non-zero rank, and resuming on another world size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cadence.summaries.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits" / "config.yaml"
TASK = f"{Path(__file__).parent / 'tasks.py'}:TinyTask"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def cadence(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def tiny_config(tmp_path: Path, steps: int = 24, **trainer) -> Path:
    cfg = {"task": {"class": TASK, "params": {"n": 256}},
           "trainer": {"train_steps": steps, "steps_per_loop": 4, "checkpoint_interval": 8,
                       "validation_interval": 8, "max_to_keep": None, "seed": 1, **trainer}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def final_weights(model_dir: Path, step: int) -> bytes:
    return (model_dir / "checkpoints" / f"ckpt-{step}" / "model.safetensors").read_bytes()


def test_digits_on_two_ranks_trains_evaluates_checkpoints_and_resumes(tmp_path):
    single = cadence("train", str(DIGITS), "--model-dir", str(tmp_path / "one"), "--no-progress")
    assert single.returncode == 0, single.stderr
    run = tmp_path / "two"
    first = cadence("train", str(DIGITS), "--model-dir", str(run), "--nproc", "2", "--no-progress",
                    "--set", "trainer.train_steps=400")
    assert first.returncode == 0, first.stdout + first.stderr
    second = cadence("train", str(DIGITS), "--model-dir", str(run), "--nproc", "2", "--no-progress")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored checkpoint" in second.stdout + second.stderr
    evals = read_metrics(run / "eval")
    assert [r["step"] for r in evals] == [200, 400, 600]  # one writer (rank 0); resumed, not redone
    one = read_metrics(tmp_path / "one" / "eval")[-1]["accuracy"]
    two = evals[-1]["accuracy"]
    assert abs(one - two) <= 0.01, (one, two)
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 600
    state = json.loads((run / "checkpoints" / "ckpt-600" / "state.json").read_text())
    assert len(state["state"]["trainer"]["rng"]) == 2  # every rank's RNG state


def test_sigterm_to_a_non_zero_rank_commits_one_step_on_all_and_resumes_exactly(tmp_path):
    config = tiny_config(tmp_path)
    straight = tmp_path / "straight"
    proc = cadence("train", str(config), "--model-dir", str(straight), "--nproc", "2", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    run = tmp_path / "run"
    pids = tmp_path / "pids"
    pids.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-m", "cadence", "train", str(config), "--model-dir", str(run), "--nproc", "2",
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
    config = tiny_config(tmp_path)
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
