"""Named evaluation splits end to end, with the weight-tied tiny GPT (tests/gpt_tasks.py) whose
validation is ``{"train": a sample of the training data, "val": held-out data}``: TensorBoard
directories per split, ``val/loss`` in ``metrics.jsonl``, ``best/``, ``cadence ls`` / ``report`` /
``evaluate`` (one process and two, on uneven shards) and the sidecar."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli_run import run_cadence
from configs import write_config

STEPS = (4, 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("named-splits")
    config = write_config(tmp, "gpt_tasks.py:TinyGPTTask", trainer={
        "train_steps": 8, "checkpoint_interval": 4, "validation_interval": 4,
        "best_checkpoint": {"metric": "val/loss", "higher_is_better": False}})
    proc = run_cadence("train", str(config), "--model-dir", str(tmp / "run"), "--no-progress", check=True)
    return config, tmp / "run", proc


def records(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def nested(record: dict) -> dict:
    """A flat ``metrics.jsonl`` record's ``split/metric`` keys as ``{split: {metric: value}}``."""
    return {split: {"loss": record[f"{split}/loss"]} for split in ("train", "val")}


def test_train_writes_each_split_to_its_own_tensorboard_dir_and_best_follows_val_loss(trained):
    _, run, proc = trained
    metrics = records(run / "eval" / "metrics.jsonl")
    assert sorted(metrics) == list(STEPS)
    for split in ("train", "val"):
        acc = EventAccumulator(str(run / "eval" / split))
        acc.Reload()
        events = acc.Scalars("loss")
        assert [(e.step, e.value) for e in events] == [
            (s, pytest.approx(metrics[s][f"{split}/loss"], rel=1e-6)) for s in STEPS]
    best = json.loads((run / "best" / "best.json").read_text())
    step = min(STEPS, key=lambda s: metrics[s]["val/loss"])
    assert (best["metric"], best["step"], best["value"]) == ("val/loss", step, metrics[step]["val/loss"])
    assert best["metrics"] == {k: v for k, v in metrics[step].items() if k not in ("step", "time")}
    assert [p.name for p in (run / "best").glob("ckpt-*")] == [f"ckpt-{step}"]
    assert f"val/loss={metrics[8]['val/loss']:.4g}" in proc.stderr  # the eval log line
    assert "done: train/loss=" in proc.stderr


def test_ls_and_report_show_the_nested_metrics(trained):
    _, run, _ = trained
    listing = run_cadence("ls", str(run), check=True).stdout
    header = next(line for line in listing.splitlines() if line.startswith("step"))
    assert header.split()[3:5] == ["val/loss", "train/loss"]
    metrics = records(run / "eval" / "metrics.jsonl")
    assert f"{metrics[8]['val/loss']:.4g}" in listing
    run_cadence("report", str(run), check=True)
    assert "val/loss" in (run / "report.html").read_text()


def test_evaluate_prints_the_nested_metrics_on_one_and_two_processes(trained):
    config, run, _ = trained
    expected = nested(records(run / "eval" / "metrics.jsonl")[4])
    one = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "4", check=True)
    single = json.loads(one.stdout)
    assert single.pop("step") == 4 and list(single) == ["train", "val"]
    assert single == {k: {"loss": pytest.approx(v["loss"], rel=1e-9)} for k, v in expected.items()}
    assert "eval at step 4" in one.stderr and "train/loss=" in one.stderr and "val/loss=" in one.stderr
    # 2 ranks, 63 windows in each split: shards of 32 and 31
    two = json.loads(run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "4",
                                 "--nproc", "2", check=True).stdout)
    assert two.pop("step") == 4
    assert two == {k: {"loss": pytest.approx(v["loss"], rel=1e-6)} for k, v in single.items()}


def test_the_sidecar_records_the_nested_metrics_of_the_in_process_evaluation(trained):
    config, run, _ = trained
    proc = run_cadence("evaluate", str(config), "--model-dir", str(run), "--continuous", "--name", "side",
                       check=True)
    in_process = records(run / "eval" / "metrics.jsonl")
    sidecar = records(run / "eval_side" / "evaluations.jsonl")
    assert sorted(sidecar) == list(STEPS)
    for step in STEPS:
        assert sidecar[step]["status"] == "evaluated"
        assert sidecar[step]["metrics"] == {
            k: {"loss": pytest.approx(v["loss"], rel=1e-9)} for k, v in nested(in_process[step]).items()}
    result = json.loads(proc.stdout)
    step = min(STEPS, key=lambda s: in_process[s]["val/loss"])
    assert result["best"] == {"metric": "val/loss", "step": step, "value": pytest.approx(in_process[step]["val/loss"])}
    assert {p.name for p in (run / "eval_side").iterdir() if p.is_dir()} == {"train", "val"}


def test_smoke_shows_the_nested_metrics_of_its_evaluation(trained):
    config, _, _ = trained
    proc = run_cadence("smoke", str(config), check=True)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PASS  evaluate"))
    assert "train/loss=" in line and "val/loss=" in line and "{" not in line
