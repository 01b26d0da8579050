"""The process tier's fork server (``tests/zygote.py``): a command forked from it behaves as the same
command in a fresh interpreter: its output, exit status, signals, environment, directory and files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from cli_run import ENV, ForkedProcess, popen, run_python
from configs import write_config


def fresh(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env or ENV, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", [
    ["-m", "cadence", "--help"],
    ["-m", "cadence", "train", "/nonexistent/config.yaml"],  # a one-line error, exit 2
    ["-c", "import sys; print(sys.argv); sys.exit('bye')"],
    ["-c", "raise ValueError('boom')"],
    ["-c", "import atexit, threading, time; atexit.register(print, 'atexit');"
           "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()", "x"],
], ids=["help", "config-error", "sys-exit-message", "uncaught", "threads-and-atexit"])
def test_a_forked_command_prints_and_exits_as_a_fresh_one(argv):
    forked, plain = run_python(argv), fresh(argv)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)


def test_it_runs_in_the_requested_directory_environment_and_module_path(tmp_path):
    code = "import json, os, sys; print(json.dumps([os.getcwd(), os.environ.get('EXTRA'), sys.path[0], sys.argv]))"
    env = {**ENV, "EXTRA": "1"}
    forked = run_python(["-c", code, "a"], env=env, cwd=str(tmp_path))
    assert json.loads(forked.stdout) == json.loads(fresh(["-c", code, "a"], env=env, cwd=str(tmp_path)).stdout)
    script = tmp_path / "script.py"
    script.write_text(code)
    assert json.loads(run_python([str(script), "b"]).stdout) == json.loads(fresh([str(script), "b"]).stdout)


def test_it_is_a_real_process_signals_end_it_and_the_status_says_which(tmp_path):
    proc = popen(["-c", "import os, time; print(os.getpid(), os.getpgid(0), flush=True); time.sleep(60)"],
                 stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert isinstance(proc, ForkedProcess)
    pid, pgid = map(int, proc.stdout.readline().split())
    assert pid == proc.pid == pgid  # its own session and group, as start_new_session gives
    os.killpg(pgid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        popen(["-c", "import time; time.sleep(60)"]).wait(0.2)
    interrupted = run_python(["-c", "raise KeyboardInterrupt"])
    assert interrupted.returncode == fresh(["-c", "raise KeyboardInterrupt"]).returncode == -signal.SIGINT


def test_a_changed_startup_variable_gets_a_fresh_interpreter():
    """``OMP_NUM_THREADS`` is read when torch starts: a forked child would keep the server's."""
    proc = popen(["-c", "import torch; print(torch.get_num_threads())"], env={**ENV, "OMP_NUM_THREADS": "2"},
                 stdout=subprocess.PIPE, text=True)
    assert not isinstance(proc, ForkedProcess)
    assert proc.communicate(timeout=120)[0].strip() == "2"


def test_a_short_training_run_ends_with_the_weights_of_a_fresh_process(tmp_path):
    from cli_run import checkpoint_weights, same_weights

    config = write_config(tmp_path, trainer={"train_steps": 8})
    for name, runner in (("forked", run_python), ("fresh", fresh)):
        proc = runner(["-m", "cadence", "train", str(config), "--model-dir", str(tmp_path / name), "--no-progress"])
        assert proc.returncode == 0, proc.stderr
    assert same_weights(checkpoint_weights(tmp_path / "forked" / "checkpoints" / "ckpt-8"),
                        checkpoint_weights(tmp_path / "fresh" / "checkpoints" / "ckpt-8"))
