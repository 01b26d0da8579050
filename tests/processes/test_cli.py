"""The ``cadence`` command end to end, as a user runs it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence as cadence

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits" / "config.yaml"
TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"


def test_digits_example_reaches_95_percent(digits_run):
    model_dir, proc = digits_run
    evals = read_metrics(str(model_dir / "eval"))
    assert [r["step"] for r in evals] == [200, 400, 600]
    assert evals[-1]["accuracy"] >= 0.95
    assert "accuracy=" in proc.stderr + proc.stdout


def test_model_dir_layout(digits_run):
    model_dir, _ = digits_run
    ckpts = model_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-200", "ckpt-400", "ckpt-600"]
    for name in ("model.safetensors", "optimizer.safetensors", "state.json", "MANIFEST.json"):
        assert (ckpts / "ckpt-600" / name).is_file()
    assert json.loads((ckpts / "FINAL").read_text())["step"] == 600
    state = json.loads((ckpts / "ckpt-600" / "state.json").read_text())
    assert state["step"] == 600 and "rng" in state["state"]["trainer"]
    assert list((model_dir / "train").glob("events.out.tfevents.*"))
    assert list((model_dir / "eval").glob("events.out.tfevents.*"))
    train_rows = read_metrics(str(model_dir / "train"))
    assert train_rows[-1]["step"] == 600 and "loss" in train_rows[-1] and "learning_rate" in train_rows[-1]
    resolved = yaml.safe_load((model_dir / "config.yaml").read_text())
    assert resolved["model_dir"] == str(model_dir)
    task_file = resolved["task"]["class"].rpartition(":")[0]
    assert Path(task_file).is_absolute() and Path(task_file).is_file()


def test_evaluate_prints_metrics_json(digits_run):
    model_dir, _ = digits_run
    proc = cadence("evaluate", str(DIGITS), "--model-dir", str(model_dir), "--checkpoint", "400")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    at_400 = [r for r in read_metrics(str(model_dir / "eval")) if r["step"] == 400][0]
    assert out["step"] == 400
    assert out["accuracy"] == pytest.approx(at_400["accuracy"], abs=1e-6)
    # evaluating writes nothing into the model dir's summaries
    assert len(read_metrics(str(model_dir / "eval"))) == 3


def test_evaluate_best_is_the_best_checkpoints_evaluation(digits_run):
    model_dir, _ = digits_run
    best_step = json.loads((model_dir / "best" / "best.json").read_text())["step"]
    best = cadence("evaluate", str(DIGITS), "--model-dir", str(model_dir), "--checkpoint", "best")
    assert best.returncode == 0, best.stderr
    by_step = cadence("evaluate", str(DIGITS), "--model-dir", str(model_dir), "--checkpoint", str(best_step))
    assert by_step.returncode == 0, by_step.stderr
    assert json.loads(best.stdout) == json.loads(by_step.stdout)
    assert json.loads(best.stdout)["step"] == best_step


def test_evaluate_missing_checkpoint_is_a_clear_error(digits_run, tmp_path):
    model_dir, _ = digits_run
    proc = cadence("evaluate", str(DIGITS), "--model-dir", str(model_dir), "--checkpoint", "123")
    assert proc.returncode == 2  # bad input: a step that does not exist
    assert proc.stderr == (f"cadence: error: no committed checkpoint for step 123 in {model_dir / 'checkpoints'}; "
                           "available steps: [200, 400, 600]\n")
    proc = cadence("evaluate", str(DIGITS), "--model-dir", str(tmp_path / "empty"))
    assert proc.returncode == 2 and "no committed checkpoint" in proc.stderr and "--initial" in proc.stderr


def test_ls_lists_checkpoints_with_eval_metrics(digits_run):
    model_dir, _ = digits_run
    proc = cadence("ls", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    for step in ("200", "400", "600"):
        assert step in proc.stdout
    assert "accuracy" in proc.stdout and "final" in proc.stdout
    missing = cadence("ls", str(model_dir / "nope"))  # bad input: exit 2, one line
    assert missing.returncode == 2 and missing.stderr == f"cadence: error: model dir not found: {model_dir / 'nope'}\n"


def test_train_on_completed_run_does_not_retrain(digits_run):
    model_dir, _ = digits_run
    before = (model_dir / "checkpoints" / "ckpt-600" / "model.safetensors").read_bytes()
    proc = cadence("train", str(DIGITS), "--model-dir", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    assert (model_dir / "checkpoints" / "ckpt-600" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize(
    "trainer, overrides, expected",
    [
        ({"train_stpes": 10}, [], ["trainer.train_stpes", "train_steps"]),
        ({"train_steps": "abc"}, [], ["trainer.train_steps", "abc"]),
        ({}, ["trainer.steps=5"], ["trainer.steps", "train_steps"]),
        ({}, ["trainer.train_steps"], ["trainer.train_steps", "key=value"]),
        ({}, ["trainer.precision=fp8"], ["trainer.precision"]),
    ],
)
def test_config_errors_are_one_clear_message(tmp_path, trainer, overrides, expected):
    cfg = {"task": {"class": TASK}, "trainer": {"train_steps": 5, "steps_per_loop": 5, **trainer}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["train", str(path), "--model-dir", str(tmp_path / "run")]
    for o in overrides:
        args += ["--set", o]
    proc = cadence(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_task_class_is_a_clear_error(tmp_path):
    for spec, text in ((f"{TASK}Nope", "has no class"), ("no_such_module_xyz:Task", "cannot import"),
                       ("json:JSONDecoder", "not a subclass")):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"task": {"class": spec}, "trainer": {"train_steps": 5}}))
        proc = cadence("train", str(path), "--model-dir", str(tmp_path / "run"))
        assert proc.returncode == 2, proc.stderr
        assert text in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1  # one line, however long the path


def test_bad_task_params_name_the_parameter(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"task": {"class": TASK, "params": {"bogus": 1}},
                                    "trainer": {"train_steps": 5}}))
    proc = cadence("train", str(path), "--model-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "bogus" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("as_float", "expected"), [
    (False, "BadLossTask.train_step returned a loss of shape (8,); expected a scalar tensor (reduce it, e.g. loss.mean())"),
    (True, "BadLossTask.train_step must return a loss tensor or a dict with 'loss', got float"),
])
def test_a_train_step_returning_a_bad_loss_is_one_line_and_exit_2(tmp_path, write_config, as_float, expected):
    cfg = write_config(tmp_path, "BadLossTask", params={"as_float": as_float}, trainer={"sanity_val_steps": 0})
    proc = cadence("--log-level", "WARNING", "train", str(cfg), "--model-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"cadence: error: {expected}"
    assert not (tmp_path / "run").exists()  # refused before its first step: nothing left (test_refused_runs.py)


def test_best_checkpoint_is_the_most_accurate_evaluation(digits_run):
    model_dir, _ = digits_run
    evals = read_metrics(str(model_dir / "eval"))
    best_row = max(evals, key=lambda r: r["accuracy"])  # max() keeps the first of equals: strict >
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert best["metric"] == "accuracy" and best["step"] == best_row["step"]
    assert best["value"] == pytest.approx(best_row["accuracy"], abs=1e-9)
    assert [p.name for p in (model_dir / "best").iterdir() if p.name.startswith("ckpt-")] == [
        f"ckpt-{best['step']}"]
    assert (model_dir / "export" / "best" / str(best["step"]) / "model.pt2").is_file()


def test_export_command_writes_artefacts_that_match_the_checkpoint(digits_run, tmp_path):
    import torch
    from safetensors.torch import load_file

    from cadence.torch import load_exported

    model_dir, _ = digits_run
    out = tmp_path / "onnx-export"
    proc = cadence("export", str(model_dir), "--checkpoint", "400", "--format", "onnx",
                   "--format", "torchscript", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "onnx" in proc.stdout and "torchscript" in proc.stdout
    # onnxscript's INFO lines (its pass manager's, unused-value notes) are dropped without --log-level debug
    # (tests/processes/test_cli_logging.py shows they are there with it)
    assert "exported onnx, torchscript" in proc.stderr
    assert "unused" not in proc.stderr and "PassManager" not in proc.stderr

    sys.path.insert(0, str(DIGITS.parent))
    try:
        from task import DigitsTask
    finally:
        sys.path.remove(str(DIGITS.parent))
    task = DigitsTask()
    model = task.build_model().eval()
    model.load_state_dict(load_file(model_dir / "checkpoints" / "ckpt-400" / "model.safetensors"))
    x = task.val_set.tensors[0][:5]
    with torch.no_grad():
        expected = model(x)
    scripted = load_exported(str(out), "torchscript")
    assert torch.allclose(scripted(x), expected, atol=1e-6)
    session = load_exported(str(out), "onnx")
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert torch.allclose(torch.from_numpy(got), expected, atol=1e-5)
    assert json.loads((out / "metadata.json").read_text())["step"] == 400


def test_export_command_errors(digits_run, tmp_path):
    model_dir, _ = digits_run
    proc = cadence("export", str(tmp_path), "--format", "safetensors")
    assert proc.returncode == 2 and "config.yaml" in proc.stderr and "Traceback" not in proc.stderr
    proc = cadence("export", str(model_dir), "--checkpoint", "soon", "--format", "safetensors")
    assert proc.returncode == 2 and "--checkpoint" in proc.stderr
    proc = cadence("export", str(model_dir), "--checkpoint", "123", "--format", "safetensors")
    assert proc.returncode == 2 and proc.stderr == (
        f"cadence: error: no committed checkpoint for step 123 in {model_dir / 'checkpoints'}; "
        "available steps: [200, 400, 600]\n")


def test_a_config_bomb_exits_2_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    """Issue 12: an alias bomb is refused before anything runs or is created."""
    from test_config import BOMB

    model_dir = tmp_path / "run"
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB.format(model_dir=model_dir))
    proc = cadence("train", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "an alias bomb?" in proc.stderr
    assert not model_dir.exists()


def test_a_model_dir_that_is_a_file_is_bad_input_for_every_command(tmp_path: Path) -> None:
    """Issue 12: exit 2 and one line naming it, from train, ls and report (no traceback)."""
    afile = tmp_path / "model_dir_file"
    afile.write_text("not a directory")
    config = tmp_path / "c.yaml"
    config.write_text("task:\n  class: tasks:TinyTask\n")
    for args in (("train", str(config), "--model-dir", str(afile), "--no-progress"), ("ls", str(afile)),
                 ("report", str(afile))):
        proc = cadence(*args, cwd=Path(__file__).parents[1])
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip() == f"cadence: error: model dir is a file, not a directory: {afile}", args
    assert afile.read_text() == "not a directory"
