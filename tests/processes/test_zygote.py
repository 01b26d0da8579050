"""The process tier's fork server (``tests/zygote.py``): a command forked from it behaves as the same
command in a fresh interpreter: its output, exit status, signals, environment, directory and files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import time

import pytest
from cli_run import ENV, alive, popen, run_python, torchrun_command
from configs import write_config
from zygote import forked


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
    assert forked(proc)
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
    assert not forked(proc)
    assert proc.communicate(timeout=120)[0].strip() == "2"


def test_a_short_training_run_ends_with_the_weights_of_a_fresh_process(tmp_path):
    from cli_run import checkpoint_weights, same_weights

    config = write_config(tmp_path, trainer={"train_steps": 8})
    for name, runner in (("forked", run_python), ("fresh", fresh)):
        proc = runner(["-m", "cadence", "train", str(config), "--model-dir", str(tmp_path / name), "--no-progress"])
        assert proc.returncode == 0, proc.stderr
    assert same_weights(checkpoint_weights(tmp_path / "forked" / "checkpoints" / "ckpt-8"),
                        checkpoint_weights(tmp_path / "fresh" / "checkpoints" / "ckpt-8"))


STARTER = """
import json, subprocess, sys, time
from cadence.cluster.launch import die_with_parent

marks = sys.argv[1]
sleeper = (
    "import os, signal, sys, time\\n"
    "def stop(*_):\\n"
    "    open(sys.argv[1], 'w').write('SIGTERM')\\n"
    "    sys.exit(0)\\n"
    "signal.signal(signal.SIGTERM, stop)\\n"
    "print(os.getppid(), flush=True)\\n"
    "time.sleep(60)\\n")
options = {"session": dict(start_new_session=True), "group": {},
           "die-with-parent": dict(start_new_session=True, preexec_fn=die_with_parent())}
kids = {name: subprocess.Popen([sys.executable, "-c", sleeper, f"{marks}/{name}"], stdout=subprocess.PIPE,
                               text=True, **kw) for name, kw in options.items()}
print(json.dumps({name: [kid.pid, int(kid.stdout.readline())] for name, kid in kids.items()}), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_the_python_processes_a_command_starts_end_as_a_fresh_interpreters_would(tmp_path, fork):
    """A forked command's own ``subprocess.Popen([sys.executable, ...])`` is forked too (its parent is the
    server), and what the parent's ``Popen`` gave it still holds: SIGKILL to the command's process group
    ends a child in that group, cadence's ``die_with_parent`` sends SIGTERM, a child in its own session
    lives on. The same run with fresh interpreters (``fork=False``) is the reference."""
    env = {**ENV, "CADENCE_TEST_FORK": "1" if fork else "0"}
    starter = popen(["-c", STARTER, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True,
                    start_new_session=True)
    try:
        kids = json.loads(starter.stdout.readline())
        assert forked(starter) == fork
        assert all((parent != starter.pid) == fork for _, parent in kids.values()), kids
        os.killpg(starter.pid, signal.SIGKILL)
        assert starter.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while alive(kids["group"][0]) or alive(kids["die-with-parent"][0]):
            assert time.monotonic() < deadline, "a child outlived its parent's group or PR_SET_PDEATHSIG"
            time.sleep(0.05)
        assert (tmp_path / "die-with-parent").read_text() == "SIGTERM"
        assert not (tmp_path / "group").exists()  # SIGKILL, as the rest of the group
        assert alive(kids["session"][0])
    finally:
        for pid, _ in kids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_torchruns_agent_and_ranks_are_forked(tmp_path):
    """torchrun's agent is forked, and so are its ranks (their parent is the server, not the agent): a job
    runs to its end with every rank's output, prefixed, and exit status 0."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint('rank', os.environ['RANK'], 'parent', os.getppid(), flush=True)\n")
    with popen(torchrun_command(2, str(worker), tee=3, external=True)[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
               text=True) as agent:
        out = agent.communicate(timeout=120)[0]
    assert agent.returncode == 0, out
    assert forked(agent)
    ranks = {line.split()[-3]: int(line.split()[-1]) for line in out.splitlines() if " parent " in line}
    assert set(ranks) == {"0", "1"} and agent.pid not in ranks.values(), out
