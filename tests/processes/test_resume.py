"""Exact resume through the CLI, as a user runs it: stopped cleanly or killed with SIGKILL after a
checkpoint, a resumed run reaches bit-identical weights to an uninterrupted one (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from cli_run import popen, run_cadence
from configs import write_config as tiny_config

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
STEPS = 60


def write_config(tmp_path: Path, **trainer) -> Path:
    return tiny_config(tmp_path, TASK, trainer={"train_steps": STEPS, "steps_per_loop": 5, "checkpoint_interval": 10,
                                                 "validation_interval": 20, "max_to_keep": 3, "seed": 3, **trainer})


cadence = partial(run_cadence, check=True)  # the CLI runner; check=False to look at a failure


def final_weights(model_dir: Path) -> bytes:
    return (model_dir / "checkpoints" / f"ckpt-{STEPS}" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> bytes:
    tmp = tmp_path_factory.mktemp("straight")
    cadence("train", str(write_config(tmp)), "--model-dir", str(tmp / "run"))
    return final_weights(tmp / "run")


def test_stopped_cleanly_then_resumed_is_bit_identical(tmp_path, uninterrupted):
    config = write_config(tmp_path)
    run = tmp_path / "run"
    cadence("train", str(config), "--model-dir", str(run), "--set", f"trainer.train_steps={STEPS // 2}")
    assert (run / "checkpoints" / f"ckpt-{STEPS // 2}" / "MANIFEST.json").exists()
    cadence("train", str(config), "--model-dir", str(run))
    assert final_weights(run) == uninterrupted


def test_killed_after_checkpoint_then_resumed_is_bit_identical(tmp_path, uninterrupted):
    config = write_config(tmp_path)
    run = tmp_path / "run"
    proc = popen(
        ["-m", "cadence", "train", str(config), "--model-dir", str(run),
         "--set", "task.params.step_sleep=0.03"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    manifest = run / "checkpoints" / "ckpt-20" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a few steps past the checkpoint: they are lost and must be redone exactly
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run / "checkpoints" / "FINAL").exists(), "the run finished before it was killed"
    assert not (run / "checkpoints" / f"ckpt-{STEPS}").exists()

    cadence("train", str(config), "--model-dir", str(run))
    assert final_weights(run) == uninterrupted


class _RunsCode:
    """Unpickling this would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_optimizer_pt_is_refused_and_nothing_runs(tmp_path):
    import hashlib
    import pickle

    config = write_config(tmp_path, train_steps=10, checkpoint_interval=None, validation_interval=None)
    run = tmp_path / "run"
    cadence("train", str(config), "--model-dir", str(run))
    ckpt = run / "checkpoints" / "ckpt-10"
    marker = tmp_path / "PWNED"
    # An attacker who can write the model dir can also rewrite the manifest to match: here the
    # optimizer state in the torch.save form (optimizer.pt, still read) instead of safetensors.
    (ckpt / "optimizer.pt").write_bytes(pickle.dumps(_RunsCode(marker)))
    (ckpt / "optimizer.safetensors").unlink()
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    del manifest["files"]["optimizer.safetensors"]
    data = (ckpt / "optimizer.pt").read_bytes()
    manifest["files"]["optimizer.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    weights = (ckpt / "model.safetensors").read_bytes()

    proc = cadence("train", str(config), "--model-dir", str(run), "--set", "trainer.train_steps=20",
                   check=False)
    assert proc.returncode == 1
    assert "optimizer.pt" in proc.stderr and "unpickl" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists(), "the crafted pickle ran code"
    # nothing already saved was lost or overwritten
    assert (ckpt / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-")) == ["ckpt-10"]


def test_model_dir_on_an_fsspec_store_trains_and_resumes(tmp_path):
    import fsspec

    from cadence.config import load_config
    from cadence.torch import run_training

    url = f"memory://cadence-test-{os.getpid()}/run"
    config = write_config(tmp_path, train_steps=20, checkpoint_interval=10, validation_interval=10)
    first = run_training(load_config(config, overrides=["trainer.train_steps=10"], model_dir=url), progress=False)
    second = run_training(load_config(config, model_dir=url), progress=False)
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/checkpoints", detail=False)}
    assert {"ckpt-10", "ckpt-20", "FINAL"} <= names
    assert fs.exists(f"{url}/config.yaml") and fs.exists(f"{url}/eval/metrics.jsonl")
    assert "accuracy" in first and "accuracy" in second
    train_rows = [json.loads(line) for line in fs.cat(f"{url}/train/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20]  # the second run resumed at 10
    fs.rm(f"memory://cadence-test-{os.getpid()}", recursive=True)


def test_sigterm_commits_the_current_step_exits_0_and_resumes_exactly(tmp_path, uninterrupted):
    config = write_config(tmp_path)
    run = tmp_path / "run"
    proc = popen(
        ["-m", "cadence", "train", str(config), "--model-dir", str(run),
         "--set", "task.params.step_sleep=0.05", "--set", "trainer.checkpoint_interval=null"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = run / "train" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (not metrics.exists() or not metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "received SIGTERM" in stderr
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-"))
    assert len(steps) == 1 and 0 < steps[0] < STEPS and steps[0] % 5 == 0  # at a loop boundary
    assert not (run / "checkpoints" / "FINAL").exists()
    last_logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1]
    assert steps[0] == last_logged  # the step it had reached, not an older one

    cadence("train", str(config), "--model-dir", str(run))
    assert final_weights(run) == uninterrupted


def test_a_corrupt_final_checkpoint_is_moved_aside_retrained_and_saved_anew(tmp_path, uninterrupted):
    """Issue 12: `cadence train` over a corrupt latest checkpoint resumes from the one before,
    retrains, and commits the step anew (bit-identical to an uninterrupted run); the damaged one
    is kept aside; `cadence ls --verify` shows it and exits 1 while it is the latest."""
    config = write_config(tmp_path)
    run = tmp_path / "run"
    cadence("train", str(config), "--model-dir", str(run))
    weights = run / "checkpoints" / f"ckpt-{STEPS}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    listed = cadence("ls", str(run), "--verify", check=False)
    assert listed.returncode == 1 and "CORRUPT" in listed.stdout and "crc32c" in listed.stdout

    retrained = " ".join(cadence("train", str(config), "--model-dir", str(run)).stderr.split())  # unwrapped
    assert "skipping checkpoint" in retrained and "moved aside to" in retrained
    assert final_weights(run) == uninterrupted  # saved anew, not the damaged file
    [aside] = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(f"ckpt-{STEPS}.corrupt-")]
    assert (aside / "model.safetensors").read_bytes() == bytes(data)  # kept for inspection

    listed = cadence("ls", str(run), "--verify")
    assert "CORRUPT" not in listed.stdout and listed.stdout.count("verified") == 3
    assert f"moved aside (did not verify): {aside}\n" in listed.stdout
