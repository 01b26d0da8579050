"""BatchNorm on 2 ranks: the model evaluated in training is the model saved. Each rank's forward passes
update its own running statistics; before every evaluation and save rank 0's (which the checkpoint holds)
are made every rank's (``cadence.torch.parallel.replicas``), so the in-process metrics of the run, and so
the step ``best/`` keeps, are exactly those of ``cadence evaluate --checkpoint STEP`` on one process and of
a sidecar over the same model dir. With DDP, with an EMA of the weights (its averages of the buffers),
and with FSDP2 (which never syncs buffers by itself)."""

from __future__ import annotations

import json

import pytest

from cadence.summaries.metrics_file import read_metrics
from configs import write_config

STEPS = (8, 16)  # a checkpoint and an evaluation at each
METRICS = ("loss", "accuracy")


@pytest.mark.parametrize("trainer", [{}, {"ema": {"decay": 0.5}}, {"strategy": "fsdp"}], ids=["ddp", "ema", "fsdp"])
def test_in_process_metrics_are_those_of_the_saved_checkpoint(tmp_path, cadence, trainer):
    config = write_config(tmp_path, "BatchNormTask", params={"n": 256},
                          trainer={"train_steps": STEPS[-1], "best_checkpoint": {"metric": "loss", "higher_is_better": False},
                                   **trainer})
    run = tmp_path / "run"
    cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress", check=True)
    in_process = {r["step"]: {k: r[k] for k in METRICS} for r in read_metrics(run / "eval")}
    assert sorted(in_process) == list(STEPS)

    evaluated = {}
    for step in STEPS:
        out = cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", str(step), check=True)
        evaluated[step] = {k: json.loads(out.stdout)[k] for k in METRICS}
    assert in_process == evaluated  # exactly: one process adds up the same per-sample numbers

    best = json.loads((run / "best" / "best.json").read_text())
    assert best["value"] == evaluated[best["step"]]["loss"]  # best/ chosen on what its checkpoint gives

    cadence("evaluate", str(config), "--model-dir", str(run), "--continuous", "--name", "check", "--timeout", "60",
            check=True)
    sidecar = {r["step"]: {k: r["metrics"][k] for k in METRICS} for r in read_metrics(run / "eval_check" / "evaluations.jsonl")}
    assert sidecar == in_process
