"""The real external evaluator: lm-eval-harness (``lm-eval``, the ``lmeval`` extra) run by the sidecar on
the ``hf`` export of each checkpoint of a tiny GPT-2 (tests/hf_tasks.py), on a multiple-choice task of
our own read from local JSON lines (nothing is downloaded: Hugging Face's libraries are offline). Its
accuracy lands in ``evaluations.jsonl`` and ``best/`` follows it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence
from gpt_tasks import markov_tokens

TESTS = Path(__file__).resolve().parents[1]
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
    lm_eval = {
        "name": "lm_eval", "format": "hf", "select": "results", "result": "{output_dir}/**/results_*.json",
        "command": [sys.executable, "-m", "lm_eval", "--model", "hf",
                    "--model_args", "pretrained={export_dir},dtype=float32", "--tasks", "markov_mc",
                    "--include_path", str(tasks), "--device", "cpu", "--batch_size", "16",
                    "--output_path", "{output_dir}"],
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
    assert [len(list((external / "lm_eval" / str(s) / "output").rglob("results_*.json"))) for s in (8, 16)] == [1, 1]
