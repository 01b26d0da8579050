"""A worker of cadence's torchrun agent ends when that agent dies (``cadence.runtime.parent_death``), with
real processes started by exec, not forked from the test zygote: through ``PR_SET_PDEATHSIG`` when the
agent is the worker's parent, through the watching thread when another process stands between them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import ROOT, alive

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
WORKER = ("import time; from cadence.runtime.parent_death import die_with_agent; die_with_agent(); "
          "import os; print('ready', os.getpid(), flush=True); time.sleep(60)")
AGENT = """
import os, subprocess, sys, time
os.environ["CADENCE_TORCHRUN_AGENT"] = str(os.getpid())
argv = [sys.executable, "-c", sys.argv[1]]
if sys.argv[2] == "through a shell":  # the worker's parent is not the agent
    argv = ["sh", "-c", 'exec "$0" -c "$1" & wait', *argv[:1], sys.argv[1]]
worker = subprocess.Popen(argv, start_new_session=True, stdout=open(sys.argv[3], "w"))
time.sleep(60)
"""


@pytest.mark.parametrize("between", ["directly", "through a shell"])
def test_a_worker_ends_when_its_agent_is_killed(tmp_path: Path, between: str) -> None:
    out = tmp_path / "worker.txt"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER, between, str(out)], env=ENV)
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text().endswith("\n")):
            assert time.monotonic() < deadline and agent.poll() is None, "the worker did not start"
            time.sleep(0.02)
        worker = int(out.read_text().split()[1])
        agent.kill()  # SIGKILL: no clean-up of its own
        agent.wait()
        deadline = time.monotonic() + 5
        while alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its agent"
            time.sleep(0.02)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
