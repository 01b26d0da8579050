"""Bad input that needs a process of its own to be real (issue 39; the in-process cases are in
tests/unit/test_cli_input_errors.py): ``cadence train`` into a directory root may not write, run as
root without CAP_DAC_OVERRIDE (a container that drops it), exits 2 in one line and creates nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import ENV
from configs import write_config

DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
"""Run a command as root without the capabilities that let root write anywhere (setpriv, util-linux)."""


def _without_dac_override(tmp_path: Path) -> None:
    """Skip, saying why, where this machine cannot run a command as root without CAP_DAC_OVERRIDE."""
    if os.geteuid() != 0:
        pytest.skip(f"runs as root, dropping CAP_DAC_OVERRIDE; this test runs as uid {os.geteuid()}")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    proc = subprocess.run([*DROP, "mkdir", str(probe / "x")], capture_output=True, text=True, check=False)
    probe.rmdir()
    if proc.returncode == 0 or "Permission denied" not in proc.stderr:
        pytest.skip(f"setpriv could not drop CAP_DAC_OVERRIDE here: {proc.stderr.strip() or 'mkdir succeeded'}")


def test_root_without_cap_dac_override_is_refused_a_model_dir_it_may_not_write(tmp_path):
    _without_dac_override(tmp_path)
    config = write_config(tmp_path / "code")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o555)  # root's, read-only to everyone
    for model_dir, message in ((shared / "run", f"model dir {shared / 'run'}: cannot create it in {shared} "
                                                "(permission denied)"),
                               (shared, f"model dir {shared}: cannot write into it (permission denied)")):
        proc = subprocess.run([*DROP, sys.executable, "-m", "cadence", "train", str(config), "--model-dir",
                               str(model_dir), "--no-progress"], capture_output=True, text=True, env=ENV,
                              timeout=120, check=False)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == f"cadence: error: {message}\n"
    assert list(shared.iterdir()) == []
