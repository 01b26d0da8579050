"""``cadence smoke CONFIG`` and :func:`cadence.torch.run_smoke`: every stage passes on a healthy
task, and each kind of broken task fails at the stage that shows it, with the later ones skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.torch import load_exported, run_smoke
from cadence.torch.experiments.smoke import STAGES, SmokeCheckError
from cli_run import run_cadence as cadence

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits" / "config.yaml"
TASKS = Path(__file__).parents[1] / "smoke_tasks.py"


def config_data(tmp_path: Path, task: str = "SmokeTask", **sections) -> dict:
    trainer = {"train_steps": 500, "steps_per_loop": 50, "checkpoint_interval": 100, "validation_steps": -1,
               "device": "cpu", **sections.pop("trainer", {})}
    return {"model_dir": str(tmp_path / "never"), "task": {"class": f"{TASKS}:{task}"}, "trainer": trainer, **sections}


def config_file(tmp_path: Path, task: str = "SmokeTask", **sections) -> Path:
    path = tmp_path / f"{task}.yaml"
    path.write_text(yaml.safe_dump(config_data(tmp_path, task, **sections)))
    return path


def stage_lines(stdout: str) -> dict[str, str]:
    """``{stage: its output line}``, checking every line starts with PASS, FAIL or SKIP."""
    lines = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1] in STAGES:
            assert words[0] in ("PASS", "FAIL", "SKIP"), line
            lines[words[1]] = line
    assert list(lines) == list(STAGES), stdout
    return lines


# -- the command ---------------------------------------------------------------------------------


def test_digits_example_passes_and_leaves_nothing_behind(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = cadence("smoke", str(DIGITS), cwd=tmp_path, env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = stage_lines(proc.stdout)
    assert all(line.startswith("PASS") for line in lines.values()), proc.stdout
    assert "2 steps, loss" in lines["train"]
    assert "accuracy=" in lines["evaluate"]
    assert "safetensors tensors equal" in lines["export"] and "torch_export outputs match" in lines["export"]
    assert "smoke test passed: 7 stages" in proc.stdout
    assert "Traceback" not in proc.stderr
    # the config's model_dir (runs/digits, relative to the cwd) is never created; the temp dir is gone
    assert not (tmp_path / "runs").exists()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("cadence-smoke-")]


def test_weight_tied_gpt_returning_logits_and_none_passes_without_a_warning(tmp_path, write_config):
    # forward(idx) returns (logits, None): the None is skipped where outputs are compared; the
    # restore stage's new run finds the writer lease released, not taken over
    cfg = write_config(tmp_path, "gpt_tasks.py:TinyGPTTask", params={"named_splits": False},
                       export={"formats": ["safetensors", "torch_export"], "on": "final"})
    proc = cadence("smoke", str(cfg))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = stage_lines(proc.stdout)
    assert all(line.startswith("PASS") for line in lines.values()), proc.stdout
    assert "outputs equal" in lines["restore"] and "torch_export outputs match" in lines["export"]
    assert "WARNING" not in proc.stderr and "writer lease" not in proc.stderr, proc.stderr


def test_failing_validation_step_fails_evaluate_and_skips_the_rest(tmp_path):
    proc = cadence("smoke", str(config_file(tmp_path, "EvalFailsTask")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = stage_lines(proc.stdout)
    assert [lines[s][:4] for s in STAGES] == ["PASS"] * 3 + ["FAIL"] + ["SKIP"] * 3
    assert "ValueError: validation labels must be float32 for the metric, got torch.int64" in lines["evaluate"]
    assert lines["checkpoint"].split() == ["SKIP", "checkpoint"]
    assert "smoke test FAILED at evaluate: 3 passed, 1 failed, 3 skipped" in proc.stdout
    # the traceback shows the user's frame, without cadence's own frames above it
    assert "Traceback" in proc.stderr and "smoke_tasks.py" in proc.stderr and "validation_step" in proc.stderr
    assert "controller.py" not in proc.stderr and "smoke.py\"" not in proc.stderr
    assert not (tmp_path / "never").exists()


def test_exports_are_written_and_loaded_and_kept_with_keep(tmp_path):
    cfg = config_file(tmp_path, trainer={"best_checkpoint": {"metric": "accuracy"}},
                      export={"formats": ["safetensors", "torchscript"], "on": "best"})
    keep = tmp_path / "kept"
    proc = cadence("smoke", str(cfg), "--keep", str(keep), "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = stage_lines(proc.stdout)
    assert "3 steps" in lines["train"]
    assert "safetensors tensors equal" in lines["export"] and "torchscript outputs match" in lines["export"]
    assert f"model dir kept: {keep}" in proc.stdout
    export = keep / "export" / "smoke" / "3"
    assert (export / "model.safetensors").is_file() and (export / "model.torchscript.pt").is_file()
    assert json.loads((export / "metadata.json").read_text())["step"] == 3
    assert (keep / "checkpoints" / "ckpt-3" / "MANIFEST.json").is_file()
    assert (keep / "best" / "best.json").is_file()  # the configured eval actions ran
    saved = yaml.safe_load((keep / "config.yaml").read_text())
    assert saved["model_dir"] == str(keep) and saved["trainer"]["train_steps"] == 3
    assert not (tmp_path / "never").exists()
    # --keep never reuses a directory with something in it
    proc = cadence("smoke", str(cfg), "--keep", str(keep))
    assert proc.returncode == 2 and "not an empty directory" in proc.stderr


def test_config_errors_exit_2(tmp_path):
    cfg = config_file(tmp_path)
    proc = cadence("smoke", str(cfg), "--set", "trainer.train_stpes=3")
    assert proc.returncode == 2 and "did you mean 'trainer.train_steps'" in proc.stderr
    assert "config" not in proc.stdout  # no stage ran
    # task.class naming a function: the config stage fails, as a config error (no traceback)
    proc = cadence("smoke", str(cfg), "--set", "task.class=" + f"{TASKS}:synthetic")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = stage_lines(proc.stdout)
    assert lines["config"].startswith("FAIL") and "ConfigError: task.class:" in lines["config"]
    assert lines["build"].split() == ["SKIP", "build"]
    assert "Traceback" not in proc.stderr


# -- run_smoke -------------------------------------------------------------------------------------


def test_run_smoke_passes_every_stage(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    report = run_smoke(config_from_dict(config_data(tmp_path)))
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG is given back
    assert report.ok and report.failed is None
    assert report.statuses() == dict.fromkeys(STAGES, "ok")
    assert report.model_dir is None
    assert "LR scheduler" in report.stage("restore").detail and "outputs" in report.stage("restore").detail
    assert report.stage("export").detail == "no exports configured (no export: section in the config)"
    assert all(s.seconds is not None and s.error is None for s in report.stages)
    assert not (tmp_path / "never").exists()


def test_an_evaluation_without_metrics_fails_evaluate(tmp_path):
    # the controller's steps_per_second (the stage evaluates 2 batches) is not a metric of the model
    report = run_smoke(config_from_dict(config_data(tmp_path, "NoMetricsTask")))
    assert report.statuses()["evaluate"] == "failed"
    assert report.stage("evaluate").error == "SmokeCheckError: the evaluation returned no metrics"


def test_build_model_raising_fails_build(tmp_path):
    report = run_smoke(config_from_dict(config_data(tmp_path, "BuildFailsTask")))
    assert report.statuses() == {"config": "ok", "build": "failed", **dict.fromkeys(STAGES[2:], "skipped")}
    build = report.stage("build")
    assert build.error == "RuntimeError: build_model: cannot find the pretrained weights 'weights/mlp.pt'"
    assert "in build_model" in build.traceback and "smoke_tasks.py" in build.traceback
    assert all(s.seconds is None for s in report.stages[2:])


def test_nan_loss_fails_train_naming_the_step(tmp_path):
    report = run_smoke(config_from_dict(config_data(tmp_path, "NaNTask")), steps=3)
    assert report.failed.name == "train"
    assert report.stage("train").error == "SmokeCheckError: the training loss at step 2 is nan"
    assert isinstance(report.stage("train").exception, SmokeCheckError)
    assert report.stage("train").traceback is None  # the message says it all
    assert report.stage("evaluate").status == "skipped"


def test_state_missing_from_the_checkpoint_fails_restore(tmp_path):
    report = run_smoke(config_from_dict(config_data(tmp_path, "UnrestoredBufferTask")))
    assert report.statuses() == {**dict.fromkeys(STAGES[:5], "ok"), "restore": "failed", "export": "skipped"}
    error = report.stage("restore").error
    assert "buffer 'projection' differs between the saved and the restored model" in error
    assert "non-persistent buffer" in error


def test_export_signatures_are_each_loaded_and_compared(tmp_path):
    data = config_data(tmp_path, "SignaturesTask", export={"formats": ["safetensors", "torchscript"], "on": "final"})
    keep = tmp_path / "kept"
    report = run_smoke(config_from_dict(data), keep_dir=str(keep))
    assert report.ok, report.failed
    assert report.model_dir == str(keep.resolve())
    detail = report.stage("export").detail
    for part in ("logits/safetensors tensors equal", "logits/torchscript outputs match",
                 "probs/safetensors tensors equal", "probs/torchscript outputs match"):
        assert part in detail
    probs = load_exported(str(keep / "export" / "smoke" / "2" / "probs"), "torchscript")
    assert torch.allclose(probs(torch.zeros(3, 8)).sum(-1), torch.ones(3))


def test_bad_arguments(tmp_path):
    cfg = config_from_dict(config_data(tmp_path))
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        run_smoke(cfg, steps=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty directory"):
        run_smoke(cfg, keep_dir=str(tmp_path / "full"))
