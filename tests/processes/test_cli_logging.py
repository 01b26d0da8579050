"""The CLI's logging: installed libraries' INFO lines (onnxscript's on every ONNX export) are
dropped unless --log-level debug; cadence's own and the user's code's pass."""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path


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


def test_an_onnx_export_prints_the_libraries_lines_with_log_level_debug(digits_run, tmp_path):
    """With ``--log-level debug`` onnxscript's lines reach the console; without it they are dropped
    (asserted on the export of tests/processes/test_cli.py::test_export_command_writes_artefacts_that_match_the_checkpoint,
    which also runs an ONNX export of the same model dir)."""
    model_dir, _ = digits_run
    loud = run_cadence("--log-level", "debug", "export", str(model_dir), "--checkpoint", "400", "--format", "onnx",
                       "--out", str(tmp_path / "b"))
    assert loud.returncode == 0, loud.stderr
    assert "exported onnx" in loud.stderr
    assert "PassManager" in loud.stderr  # the library's lines are there when asked for
