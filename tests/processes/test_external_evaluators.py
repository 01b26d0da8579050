"""External evaluators (``evaluators:``) as users run them: commands run by the sidecar (`cadence evaluate
--continuous`) and by `cadence evaluate --checkpoint` on each checkpoint, with their metrics in the
record, the summaries, `cadence ls` and `best/`; commands that fail, fail once, time out; a sidecar killed
with SIGKILL while a command runs. The commands are tests/external_fake.py (real processes); the last test
runs the real thing: lm-eval-harness (the ``lmeval`` extra) by the sidecar on the ``hf`` export of each
checkpoint of a tiny GPT-2 (tests/hf_tasks.py), on a multiple-choice task of our own read from local
JSON lines (nothing is downloaded: Hugging Face's libraries are offline, tests/cli_run.py's ENV)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import alive, popen, run_cadence
from gpt_tasks import markov_tokens

TESTS = Path(__file__).resolve().parents[1]
FAKE = str(TESTS / "external_fake.py")
STEPS = [2, 4, 6, 8]


def fake(mode: str, state: Path, *extra: str) -> list[str]:
    """tests/external_fake.py in ``mode``: the command's arguments, as a list of templates."""
    return [sys.executable, FAKE, mode, "--step", "{step}", "--out", "{output_dir}", "--state", str(state), *extra]


def write_config(directory: Path, evaluators: list[dict], **sections) -> Path:
    cfg = {"task": {"class": f"{TESTS / 'tasks.py'}:TinyTask"},
           "trainer": {"train_steps": 8, "steps_per_loop": 2, "checkpoint_interval": 2, "max_to_keep": None,
                       "seed": 0, "best_checkpoint": {"metric": "score/t/acc"}},
           "sidecar": {"poll_interval": 0.05, "timeout": 120},
           "evaluators": evaluators, **sections}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A model dir with checkpoints at steps 2, 4, 6, 8 and FINAL, trained without evaluating."""
    root = tmp_path_factory.mktemp("external")
    config = write_config(root, [])
    run_cadence("train", str(config), "--model-dir", str(root / "run"), "--no-progress",
                "--set", "trainer.in_process_validation=false", check=True)
    return root / "run"


def pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def records(model_dir: Path) -> list[dict]:
    return read_metrics(model_dir / "eval" / "evaluations.jsonl")


def test_sidecar_runs_each_command_on_each_checkpoint_and_records_failures(trained, tmp_path):
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    state = tmp_path / "state"
    state.mkdir()
    config = write_config(tmp_path, [
        {"name": "score", "command": [*fake("score", state), "--checkpoint", "{checkpoint_dir}"], "select": "results"},
        {"name": "file", "command": " ".join(fake("file", state)), "result": "{output_dir}/**/results_*.json",
         "select": "results", "prefix": "f/x"},
        {"name": "flaky", "command": fake("flaky", state), "retries": 1},
        {"name": "broken", "command": fake("broken", state, "--bad-step", "6"), "retries": 2},
        {"name": "slow", "command": fake("slow", state, "--bad-step", "8"), "timeout_s": 1, "retries": 0},
    ], callbacks=[{"class": f"{TESTS / 'callback_tasks.py'}:EvalMetricsLog", "params": {"path": str(tmp_path / "cb")}}])
    proc = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = records(model_dir)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]
    for r in rows:
        step, m, ext = r["step"], r["metrics"], r["external"]
        acc = 1 - abs(step - 4) / 10  # what the command computed from its {step}
        assert m["score/t/acc"] == pytest.approx(acc) and m["f/x/t/acc"] == pytest.approx(acc)
        assert "score/t/alias" not in m and "score/t/acc_stderr" not in m and "loss" in m  # strings dropped
        assert ext["score"]["status"] == "ok" and ext["score"]["attempts"] == 1
        assert ext["flaky"] == {**ext["flaky"], "status": "ok", "attempts": 2} and m["flaky/ok"] == 2
        if step == 6:  # exit 5 on every attempt: recorded, the other metrics still count
            assert ext["broken"] == {**ext["broken"], "status": "failed", "exit": 5, "attempts": 3,
                                     "last_line": "broken: no luck at step 6"}
            assert "broken/ok" not in m
        else:
            assert ext["broken"]["status"] == "ok" and m["broken/ok"] == 1
        if step == 8:
            assert ext["slow"] == {**ext["slow"], "status": "timeout", "exit": None, "last_line": "slow: sleeping"}
        else:
            assert ext["slow"]["status"] == "ok"
    assert [len((state / f"broken-{s}").read_text().splitlines()) for s in STEPS] == [1, 1, 3, 1]  # bounded
    child = int((state / "slow-child").read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:  # the timeout killed its process group
        time.sleep(0.05)
    assert not alive(child)
    # the metrics reached the summaries (TensorBoard's metrics.jsonl), best/ and cadence ls
    summaries = {r["step"]: r for r in read_metrics(model_dir / "eval" / "metrics.jsonl")}
    assert [summaries[s]["score/t/acc"] for s in STEPS] == [r["metrics"]["score/t/acc"] for r in rows]
    best = max(rows, key=lambda r: r["metrics"]["score/t/acc"])
    assert json.loads((model_dir / "best" / "best.json").read_text())["step"] == best["step"]
    assert json.loads(proc.stdout)["best"]["step"] == best["step"]
    # the callbacks (trackers are callbacks, fed by the same on_eval_end) got them too
    seen = [json.loads(line) for line in (tmp_path / "cb").read_text().splitlines()]
    assert [(e["step"], e["metrics"]["score/t/acc"]) for e in seen] == [(r["step"], r["metrics"]["score/t/acc"]) for r in rows]
    listing = run_cadence("ls", str(model_dir), "--json", check=True)
    assert "score/t/acc" in listing.stdout
    # each run kept in eval/external/<name>/<step>/; the exports deleted
    assert (model_dir / "eval" / "external" / "score" / "8" / "stdout.txt").read_text().startswith("a log line")
    assert not list((model_dir / "eval" / "external").glob(".export-*"))
    assert not list((model_dir / "checkpoints" / ".leases").glob("*.json"))


def test_evaluate_checkpoint_runs_the_commands_and_prints_their_metrics(trained, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    before = sorted(p.relative_to(trained) for p in trained.rglob("*"))
    config = write_config(tmp_path, [
        {"name": "score", "command": [*fake("score", state), "--checkpoint", "{checkpoint_dir}"], "select": "results"},
        {"name": "side", "command": fake("broken", state), "on": ["sidecar"]},
        {"name": "st", "command": [*fake("file", state), "--expect-file", "{export_dir}/model.safetensors"],
         "format": "safetensors", "result": "{output_dir}/sub/results_{step}.json", "select": "results/t",
         "on": ["evaluate"]},
    ])
    proc = run_cadence("evaluate", str(config), "--model-dir", str(trained), "--checkpoint", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["step"] == 6 and "loss" in printed
    assert printed["score/t/acc"] == pytest.approx(0.8) and printed["st/acc"] == pytest.approx(0.8)
    assert not (state / "broken-6").exists()  # on: [sidecar] only
    assert sorted(p.relative_to(trained) for p in trained.rglob("*")) == before  # the model dir untouched



def test_a_backfill_runs_the_commands_and_records_what_they_did(trained, tmp_path):
    """``cadence evaluate --steps`` (a backfill) runs the sidecar's commands on each listed checkpoint: their
    metrics and outcome in its records, ``best/`` following the commands' metric."""
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    state = tmp_path / "state"
    state.mkdir()
    config = write_config(tmp_path, [{"name": "score", "command": fake("score", state), "select": "results"}])
    proc = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--steps", "8,4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = records(model_dir)
    assert [(r["step"], r["status"]) for r in rows] == [(4, "evaluated"), (8, "evaluated")]
    assert all(r["external"]["score"]["status"] == "ok" for r in rows)
    assert [r["metrics"]["score/t/acc"] for r in rows] == pytest.approx([1.0, 0.6])  # the command's, from {step}
    assert json.loads((model_dir / "best" / "best.json").read_text())["step"] == 4

def test_sidecar_killed_while_a_command_runs_runs_it_again_and_records_the_step_once(trained, tmp_path):
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    state = tmp_path / "state"
    state.mkdir()
    config = write_config(tmp_path, [
        {"name": "score", "command": fake("score", state), "select": "results"},
        {"name": "hang", "command": fake("hang-once", state, "--bad-step", "4")},
    ])
    argv = ["-m", "cadence", "evaluate", str(config), "--model-dir", str(model_dir), "--continuous"]
    sidecar = popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = state / "hang-started"
    deadline = time.monotonic() + 120
    while pid_in(started) is None and sidecar.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    command = pid_in(started)  # the first run of "hang" at step 4 sleeps
    assert command is not None, "the command never started"

    assert [r["step"] for r in records(model_dir)] == [2]
    os.kill(sidecar.pid, signal.SIGKILL)
    sidecar.wait()
    deadline = time.monotonic() + 10
    while alive(command) and time.monotonic() < deadline:  # it ends with the sidecar (no orphan)
        time.sleep(0.05)
    assert not alive(command)

    restarted = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    rows = records(model_dir)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in STEPS]  # step 4 once
    step4 = rows[1]
    assert step4["external"]["hang"]["status"] == "ok" and step4["metrics"]["hang/ok"] == 2  # its second run
    assert len((state / "score-4").read_text().splitlines()) == 2  # the step was evaluated again, whole
    summaries = [r["step"] for r in read_metrics(model_dir / "eval" / "metrics.jsonl")]
    assert summaries == STEPS  # the killed evaluation wrote no summary


def test_in_process_evaluations_run_on_train_commands_and_early_stopping_reads_them(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    config = write_config(tmp_path, [
        {"name": "score", "command": fake("score", state), "select": "results", "on": ["train"]},
        {"name": "side", "command": fake("broken", state)},  # sidecar and evaluate: not in training
    ])
    model_dir = tmp_path / "run"
    proc = run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress",
                       "--set", "trainer.train_steps=12", "--set", "trainer.validation_interval=2",
                       "--set", "trainer.sanity_val_steps=1",
                       "--set", "trainer.early_stopping={metric: score/t/acc, patience: 1}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    evals = read_metrics(model_dir / "eval" / "metrics.jsonl")
    values = [e["score/t/acc"] for e in evals]
    assert values == pytest.approx([1 - abs(e["step"] - 4) / 10 for e in evals])
    # no improvement after the peak for one evaluation (patience 1): training stops there
    peak = values.index(max(values))
    final = json.loads((model_dir / "checkpoints" / "FINAL").read_text())
    assert final["step"] == evals[peak + 1]["step"] == evals[-1]["step"] and "early stopping" in final["reason"]
    assert sorted(p.name for p in state.iterdir()) == [f"score-{e['step']}" for e in evals]  # not the sanity check's
    assert json.loads((model_dir / "best" / "best.json").read_text())["step"] == evals[peak]["step"]


# -- lm-eval-harness, for real ------------------------------------------------------------------

TASK_YAML = """\
task: markov_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(directory: Path, n: int = 40) -> Path:
    """``n`` items of the Markov language the model learns: six tokens, then the token that followed
    them and three others (the answer first); the task's YAML beside them."""
    directory.mkdir()
    tokens = markov_tokens(n * 8, 32, seed=3).tolist()
    with (directory / "items.jsonl").open("w") as f:
        for i in range(n):
            context, answer = tokens[i * 8: i * 8 + 6], tokens[i * 8 + 6]
            choices = [answer, *((answer + k) % 32 for k in (7, 13, 21))]
            f.write(json.dumps({"context": " ".join(f"t{t}" for t in context),
                                "choices": [f"t{c}" for c in choices], "label": 0}) + "\n")
    (directory / "markov_mc.yaml").write_text(TASK_YAML.format(items=directory / "items.jsonl"))
    return directory


def test_lm_eval_on_the_hf_export_of_each_checkpoint(tmp_path):
    tasks = write_task(tmp_path / "tasks")
    lm_eval = {  # lm-eval's simple_evaluate on our task folder alone (its CLI indexes all its tasks first)
        "name": "lm_eval", "format": "hf", "select": "results",
        "command": [sys.executable, str(TESTS / "lm_eval_local.py"), "{export_dir}", str(tasks), "markov_mc"],
        "env": {"HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")}, "timeout_s": 300,
    }
    cfg = {"task": {"class": f"{TESTS / 'hf_tasks.py'}:TinyHFGPT2Task", "params": {"lr": 0.01}},
           "trainer": {"train_steps": 16, "steps_per_loop": 8, "checkpoint_interval": 8, "max_to_keep": None,
                       "seed": 0, "best_checkpoint": {"metric": "lm_eval/markov_mc/acc"}},
           "sidecar": {"poll_interval": 0.05, "timeout": 300}, "evaluators": [lm_eval]}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    model_dir = tmp_path / "run"
    run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress",
                "--set", "trainer.in_process_validation=false", check=True)
    proc = run_cadence("evaluate", str(config), "--model-dir", str(model_dir), "--continuous", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(model_dir / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(8, "evaluated"), (16, "evaluated")]
    for r in rows:
        assert r["external"]["lm_eval"]["status"] == "ok", r["external"]
        acc = r["metrics"]["lm_eval/markov_mc/acc"]
        assert 0 <= acc <= 1 and abs(acc * 40 - round(acc * 40)) < 1e-9  # a fraction of the 40 items
        assert r["metrics"]["lm_eval/markov_mc/sample_len"] == 40 and "lm_eval/markov_mc/acc_stderr" in r["metrics"]
    best = max(rows, key=lambda r: r["metrics"]["lm_eval/markov_mc/acc"])  # the first of equals
    assert json.loads((model_dir / "best" / "best.json").read_text())["step"] == best["step"]
    summaries = read_metrics(model_dir / "eval" / "metrics.jsonl")
    assert [s["lm_eval/markov_mc/acc"] for s in summaries] == [r["metrics"]["lm_eval/markov_mc/acc"] for r in rows]
    external = model_dir / "eval" / "external"
    assert not list(external.glob(".export-*"))  # the hf exports deleted after the command
    assert all('"results"' in (external / "lm_eval" / str(s) / "stdout.txt").read_text() for s in (8, 16))
