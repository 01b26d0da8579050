"""Issue 27, items 3 to 5, through the CLI on the weight-tied tiny GPT (tests/gpt_tasks.py): ``cadence
evaluate`` of a model dir without a checkpoint (one line naming ``--initial``, exit 2) and with
``--initial``; ``trainer.eval_at_start`` (the same baseline at step 0, which ``best/`` never keeps); the
``learning_rate`` logged at a loop's last step (the rate that step trained at, nanoGPT's formula); and the
progress line's rates (one window: steps/s x samples per step == samples/s)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence
from configs import write_config

BATCH, LR = 8, 3e-3  # TinyGPTTask's defaults
SCHEDULE = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 6, "min_lr": 3e-4, "convention": "nanogpt"}
TRAINER = {"train_steps": 8, "steps_per_loop": 4, "checkpoint_interval": 4, "validation_interval": 4,
           "eval_at_start": True, "lr_schedule": SCHEDULE, "best_checkpoint": {"metric": "loss", "higher_is_better": False}}


def nanogpt_lr(it: int) -> float:
    """nanoGPT's get_lr(it), with SCHEDULE's settings."""
    warmup, decay, low = SCHEDULE["warmup_steps"], SCHEDULE["decay_steps"], SCHEDULE["min_lr"]
    if it < warmup:
        return LR * (it + 1) / (warmup + 1)
    if it > decay:
        return low
    return low + 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (LR - low)


def test_evaluate_initial_eval_at_start_the_logged_rate_and_the_progress_line(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, "gpt_tasks.py:TinyGPTTask", params={"named_splits": False}, trainer=TRAINER))
    run = tmp_path / "run"

    nothing = run_cadence("evaluate", config, "--model-dir", str(run))
    assert nothing.returncode == 2 and nothing.stdout == ""
    assert nothing.stderr.splitlines() == [
        f"cadence: error: no committed checkpoint in {run}/checkpoints: nothing to evaluate "
        "(--initial evaluates the initialized model)"]

    initial = run_cadence("evaluate", config, "--model-dir", str(run), "--initial", check=True)
    baseline = json.loads(initial.stdout)
    assert baseline["step"] == 0 and baseline["loss"] > 3.0  # about log(32): untrained

    trained = run_cadence("train", config, "--model-dir", str(run), check=True)
    evals = read_metrics(str(run / "eval"))
    assert [r["step"] for r in evals] == [0, 4, 8] and evals[0]["loss"] == baseline["loss"]
    assert json.loads((run / "best" / "best.json").read_text())["step"] in (4, 8)  # never the untrained weights
    both = run_cadence("evaluate", config, "--model-dir", str(run), "--initial", "--checkpoint", "4")
    assert both.returncode == 2 and both.stderr.splitlines() == [
        "cadence: error: --initial evaluates no checkpoint: leave out --checkpoint and --continuous"]

    # learning_rate at step N (a loop's last): the rate step N trained at, nanoGPT's iteration N - 1
    rates = {r["step"]: r["learning_rate"] for r in read_metrics(str(run / "train"))}
    assert rates.keys() == {4, 8}
    assert all(math.isclose(rate, nanogpt_lr(step - 1), rel_tol=1e-9) for step, rate in rates.items()), rates

    # the closing progress line: its steps/s and samples/s are the last loop's
    (line,) = [line for line in trained.stderr.splitlines() if line.startswith("step 8/8")]
    steps = re.search(r"([\d.]+) steps/s", line)
    samples = re.search(r"([\d.]+)(k?) samples/s", line)
    assert steps and samples, line
    per_second = float(samples[1]) * (1000 if samples[2] else 1)
    # steps/s to 0.1, samples/s to 3 significant digits: equal up to their rounding
    rounding = BATCH * 0.05 + 0.5 * 10 ** (math.floor(math.log10(per_second)) - 2)
    assert abs(float(steps[1]) * BATCH - per_second) <= rounding * 1.001, line
