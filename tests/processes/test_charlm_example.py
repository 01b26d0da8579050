"""The charlm example (examples/charlm): a small causal transformer on generated arithmetic. It
learns in a few hundred CPU steps, trains sharded (FSDP2 over its transformer layers) on 2
processes into checkpoints with the single-process keys, and runs with a sidecar evaluator."""

from __future__ import annotations

import json
import math
import re
from functools import partial
from pathlib import Path

import pytest
import yaml
from torch import nn

from cadence.summaries.metrics_file import read_metrics
from by_path import module_loaded
from cli_run import checkpoint_weights, run_cadence

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "charlm" / "config.yaml"
cadence = partial(run_cadence, env={"COLUMNS": "200"})  # the CLI runner, 200 columns wide
CHANCE = 1 / 13  # uniform over the 13 characters "0123456789+=;"
SHORT = ("trainer.train_steps=40", "trainer.steps_per_loop=20", "trainer.checkpoint_interval=20",
         "trainer.validation_interval=20")


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def final_model(model_dir: Path, step: int) -> dict:
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == step
    return checkpoint_weights(model_dir / "checkpoints" / f"ckpt-{step}")


def verified(model_dir: Path) -> None:
    proc = cadence("ls", "--verify", str(model_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("charlm") / "single"
    proc = cadence("train", str(CONFIG), "--model-dir", str(model_dir), "--no-progress",
                   *sets("trainer.train_steps=200", "trainer.checkpoint_interval=100",
                         "trainer.validation_interval=100"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return model_dir


@pytest.fixture(scope="module")
def task_module():
    # By its path, under a name of its own: another example's ``task`` module may already be imported
    # in this process (the digits one, by an earlier test on the same xdist worker).
    with module_loaded("charlm_example_task", CONFIG.parent / "task.py") as module:
        yield module


def test_the_corpus_is_deterministic_and_the_transformer_layers_are_the_fsdp_units(task_module):
    a, b = task_module.CharLMTask(), task_module.CharLMTask()
    for x, y in zip(a.train_set.tensors + a.val_set.tensors, b.train_set.tensors + b.val_set.tensors):
        assert x.equal(y)
    x, y, answer = a.train_set[0]
    assert x[1:].equal(y[:-1])  # y is x shifted by one character
    text = "".join(task_module.VOCAB[i] for i in x) + task_module.VOCAB[y[-1]]
    sums = re.findall(r"(\d+)\+(\d+)=(\d+);", text)
    assert sums and all(int(a) + int(b) == int(c) for a, b, c in sums)
    flags, inside = [], False  # the answer mask: the digits after "=" and the ";" closing them
    for c in text:
        flags.append(float(inside))
        inside = c == "=" or (inside and c != ";")
    assert answer.tolist() == flags[1:]
    model = a.build_model()
    assert 10_000 < sum(p.numel() for p in model.parameters()) < 100_000
    units = a.fsdp_units(model)
    assert len(units) == 2 and all(isinstance(u, nn.TransformerEncoderLayer) for u in units)


def test_a_short_run_learns_and_its_checkpoints_verify(single_run):
    evals = read_metrics(str(single_run / "eval"))
    assert [r["step"] for r in evals] == [100, 200]
    # Measured on CPU: accuracy 0.419 (5.4x chance), loss 1.54 at step 200; conservative bounds.
    assert evals[-1]["accuracy"] > 3 * CHANCE
    assert evals[-1]["loss"] < 0.8 * math.log(13)  # below the uniform model's cross-entropy
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert 0.0 < evals[-1]["answer_accuracy"] <= 1.0
    best = json.loads((single_run / "best" / "best.json").read_text())
    assert best["metric"] == "accuracy" and best["step"] == max(evals, key=lambda r: r["accuracy"])["step"]
    verified(single_run)
    # The task counts tokens (every input character): tokens/s = samples/s x the sequence length.
    config = yaml.safe_load(CONFIG.read_text())["task"]["params"]
    for record in read_metrics(str(single_run / "train")):
        assert record["tokens_per_second"] == pytest.approx(record["samples_per_second"] * config["seq_len"])
        assert record["samples_per_second"] == pytest.approx(record["steps_per_second"] * config["batch_size"])


def test_fsdp_on_two_processes_writes_sharded_checkpoints_with_the_single_process_keys(single_run, tmp_path):
    model_dir = tmp_path / "fsdp"
    proc = cadence("train", str(CONFIG), "--model-dir", str(model_dir), "--nproc", "2", "--no-progress",
                   *sets("trainer.strategy=fsdp", *SHORT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "view tensor" not in proc.stderr  # the root returns fresh logits (FSDP2 warns on a view)
    sharded, single = final_model(model_dir, 40), final_model(single_run, 200)
    assert {k: v.shape for k, v in sharded.items()} == {k: v.shape for k, v in single.items()}
    assert [r["step"] for r in read_metrics(str(model_dir / "eval"))] == [20, 40]
    verified(model_dir)
    assert (model_dir / "checkpoints" / "ckpt-40" / "__1_0.distcp").exists()  # rank 1 wrote its shards
    # the sharded checkpoint resumes without sharding too (one process), optimizer state included
    resumed = cadence("train", str(CONFIG), "--model-dir", str(model_dir), "--no-progress",
                      *sets(*SHORT, "trainer.train_steps=60"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "restored checkpoint" in resumed.stderr and "ckpt-40" in resumed.stderr
    assert [r["step"] for r in read_metrics(str(model_dir / "eval"))] == [20, 40, 60]
    verified(model_dir)


@pytest.mark.parametrize("extra", [(), ("--nproc", "2", "--set", "trainer.strategy=fsdp")], ids=["one", "fsdp2"])
def test_the_sidecar_evaluates_every_checkpoint(tmp_path, extra):
    model_dir = tmp_path / "sidecar"
    proc = cadence("launch", str(CONFIG), "--sidecar", "--model-dir", str(model_dir), *sets(*SHORT), *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(model_dir / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(20, "evaluated"), (40, "evaluated")]
    assert json.loads((model_dir / "best" / "best.json").read_text())["metric"] == "accuracy"
    sharded = (model_dir / "checkpoints" / "ckpt-40" / "__1_0.distcp").exists()
    assert sharded == bool(extra)  # with --nproc 2 and fsdp, rank 1 wrote its shards
    verified(model_dir)
