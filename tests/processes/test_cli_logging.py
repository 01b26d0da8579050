"""The CLI's logging: installed libraries' INFO lines (onnxscript's on every ONNX export) are
dropped unless --log-level debug; cadence's own and the user's code's pass."""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import yaml

from cadence.cli.logs import quiet_third_party
from cli_run import run_cadence


def record(name: str, level: int, pathname: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, pathname, 1, "message", None, None)


def test_only_installed_libraries_records_below_warning_are_dropped(tmp_path):
    library = str(Path(sysconfig.get_paths()["purelib"]) / "onnxscript" / "optimizer.py")
    assert not quiet_third_party(record("onnxscript.optimizer", logging.INFO, library))
    assert quiet_third_party(record("onnxscript.optimizer", logging.WARNING, library))
    assert quiet_third_party(record("cadence.torch.export.api", logging.INFO, library))  # cadence, installed or not
    assert quiet_third_party(record("mytask", logging.INFO, str(tmp_path / "task.py")))  # the user's code


def test_an_onnx_export_prints_cadence_lines_only_unless_debug(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"class": f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"},
        "trainer": {"train_steps": 4, "steps_per_loop": 2, "validation_interval": 2,
                    "best_checkpoint": {"metric": "accuracy"}}}))
    run = tmp_path / "run"
    assert run_cadence("train", str(config), "--model-dir", str(run), "--no-progress").returncode == 0
    quiet = run_cadence("export", str(run), "--format", "onnx", "--out", str(tmp_path / "a"))
    assert quiet.returncode == 0, quiet.stderr
    assert "exported onnx" in quiet.stderr
    assert "unused" not in quiet.stderr and "PassManager" not in quiet.stderr
    loud = run_cadence("--log-level", "debug", "export", str(run), "--format", "onnx", "--out", str(tmp_path / "b"))
    assert loud.returncode == 0, loud.stderr
    assert "PassManager" in loud.stderr  # the library's lines are there when asked for
