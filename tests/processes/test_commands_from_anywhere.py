"""A model dir's commands from any directory (issue 40): ``cadence train`` records the directory it ran in
(``workdir``, relative to the model dir's ``config.yaml`` inside the project), and ``cadence export``,
``evaluate`` and the sidecar given that config run the Task there, so a relative ``task.params`` path (the
hf_gpt2 example's ``data_dir``) and ``task.init_from_pretrained`` mean what they meant at training; the
paths typed on their command line stay relative to where they are typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence as cadence
from configs import write_config

TRAINER = {"train_steps": 8, "checkpoint_interval": 4, "validation_interval": 4,
           "best_checkpoint": {"metric": "loss", "higher_is_better": False}}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project trained from its root: ``conf/config.yaml`` (DataDirTask, ``data_dir: data``, ``model_dir:
    runs/x``, both relative to the root), its model dir ``runs/x``; and a directory ``other/`` beside it."""
    root = tmp_path_factory.mktemp("workdir")
    proj = root / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "scale.txt").write_text("2.0")
    write_config(proj / "conf", "DataDirTask", params={"data_dir": "data"}, trainer=TRAINER, model_dir="runs/x")
    cadence("train", "conf/config.yaml", "--no-progress", cwd=proj, check=True)
    (root / "other").mkdir()
    return proj


def test_the_model_dir_records_where_the_run_trained_relative_to_itself(project):
    assert yaml.safe_load((project / "runs" / "x" / "config.yaml").read_text())["workdir"] == "../.."


def test_evaluate_from_another_directory_reads_the_tasks_relative_data(project):
    other, model_dir = project.parent / "other", "../proj/runs/x"
    proc = cadence("evaluate", f"{model_dir}/config.yaml", "--model-dir", model_dir, "--checkpoint", "8", cwd=other)
    assert proc.returncode == 0, proc.stderr
    trained = [r for r in read_metrics(project / "runs" / "x" / "eval") if r["step"] == 8][0]
    out = json.loads(proc.stdout)
    assert out["step"] == 8 and out["loss"] == pytest.approx(trained["loss"], abs=1e-6)
    # the mechanism: with the recorded directory set aside, the Task's relative data_dir is not found
    plain = cadence("evaluate", f"{model_dir}/config.yaml", "--model-dir", model_dir, "--set", "workdir=null",
                    cwd=other)
    assert plain.returncode == 2 and "task.params.data_dir: no scale.txt in data" in plain.stderr, plain.stderr


def test_export_from_another_directory_writes_where_out_says(project):
    other = project.parent / "other"
    proc = cadence("export", "../proj/runs/x", "--checkpoint", "best", "--format", "safetensors",
                   "--out", "exported", cwd=other)
    assert proc.returncode == 0, proc.stderr
    assert (other / "exported" / "model.safetensors").is_file()  # --out is relative to where it is typed
    assert not (project / "exported").exists()


def test_the_sidecar_from_another_directory_evaluates_every_checkpoint(project):
    other, model_dir = project.parent / "other", "../proj/runs/x"
    proc = cadence("evaluate", f"{model_dir}/config.yaml", "--model-dir", model_dir, "--continuous",
                   "--name", "elsewhere", "--timeout", "120", cwd=other)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(project / "runs" / "x" / "eval_elsewhere" / "evaluations.jsonl")
    trained = {r["step"]: r["loss"] for r in read_metrics(project / "runs" / "x" / "eval")}
    assert [(r["step"], r["status"]) for r in rows] == [(4, "evaluated"), (8, "evaluated")]
    assert all(r["metrics"]["loss"] == pytest.approx(trained[r["step"]], abs=1e-6) for r in rows)
    assert not (other / "runs").exists()


def test_init_from_pretrained_relative_to_the_run_from_another_directory(tmp_path):
    from hf_tasks import tiny_gpt2

    proj, other = tmp_path / "proj", tmp_path / "other"
    other.mkdir()
    tiny_gpt2(seed=3).save_pretrained(proj / "pretrained")
    write_config(proj, "hf_tasks.py:TinyHFGPT2Task", params={"n_tokens": 512}, model_dir="runs/x",
                 trainer={"train_steps": 4, "checkpoint_interval": 4, "validation_interval": 4})
    cadence("train", "config.yaml", "--no-progress", "--set", "task.init_from_pretrained=pretrained", cwd=proj,
            check=True)
    here = cadence("evaluate", "runs/x/config.yaml", "--model-dir", "runs/x", "--initial", cwd=proj, check=True)
    there = cadence("evaluate", "../proj/runs/x/config.yaml", "--model-dir", "../proj/runs/x", "--initial",
                    cwd=other)
    assert there.returncode == 0, there.stderr
    assert json.loads(there.stdout) == json.loads(here.stdout)
