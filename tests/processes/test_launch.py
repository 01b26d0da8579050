"""``cadence.cluster.launch``: real child processes (small ``python -c`` programs), real signals."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cadence.errors import ConfigError
from cli_run import alive
from cadence.cluster.launch import launch, launch_exit_code, sidecar_commands

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")

# Prints "pid N" once it is ready (SIGTERM ignored if asked), then sleeps "forever".
SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    if "ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for arg in sys.argv[1:]:  # ready=PATH: the file is there once the handlers are
        if arg.startswith("ready="):
            open(arg[len("ready="):], "w").close()
    print("pid", os.getpid(), flush=True)
    time.sleep(60)
""")

# Starts a grandchild sleeper in its own process group, prints both pids, sleeps or exits.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("pid", os.getpid(), flush=True)
    print("pid", child.pid, flush=True)
    if "exit" not in sys.argv:
        time.sleep(60)
""")


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


@pytest.fixture
def leftovers():
    """Pids a test saw; any still alive at teardown (a failed test) are killed, not leaked."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def lines_of(text: str, name: str) -> list[str]:
    prefix = f"[{name}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


# --- output and return codes -----------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    name = sys.argv[1]
    for i in range(40):
        # a line in three writes, with a pause in the middle: must still come out whole
        sys.stdout.write(f"{name} line {i} ")
        sys.stdout.flush()
        time.sleep(0.001)
        sys.stdout.write("x" * 3000)
        sys.stdout.flush()
        sys.stdout.write(f" end {i}\\n")
        sys.stdout.flush()
        if i % 10 == 0:
            print(f"{name} err {i} \\u00e9", file=sys.stderr, flush=True)
    sys.stdout.write(f"{name} last line without newline")
""")


def test_lines_are_whole_prefixed_and_each_appears_once() -> None:
    out = io.StringIO()
    codes = launch({"a": [PY, "-c", WRITER, "a"], "b": [PY, "-c", WRITER, "b"]}, out=out)
    assert codes == {"a": 0, "b": 0}
    text = out.getvalue()
    assert all(re.match(r"\[(a|b)\] ", line) for line in text.splitlines()), text[:500]
    for name in ("a", "b"):
        got = lines_of(text, name)
        expected = [f"{name} line {i} {'x' * 3000} end {i}" for i in range(40)]
        assert [g for g in got if " end " in g] == expected  # complete, in order, once
        assert [g for g in got if " err " in g] == [f"{name} err {i} \u00e9" for i in range(0, 40, 10)]
        assert got[-1] == f"{name} last line without newline"
        assert len(got) == 40 + 4 + 1


def test_return_codes_and_environment() -> None:
    out = io.StringIO()
    codes = launch(
        {
            "ok": [PY, "-c", "import os; print(os.environ['PYTHONUNBUFFERED'], os.environ['EXTRA'])"],
            "three": [PY, "-c", "raise SystemExit(3)"],
            "killed": [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
            "missing": ["/nonexistent/cadence-test-binary"],
        },
        env={"EXTRA": "yes"},
        out=out,
    )
    assert codes == {"ok": 0, "three": 3, "killed": -signal.SIGKILL, "missing": 127}
    assert list(codes) == ["ok", "three", "killed", "missing"]
    assert lines_of(out.getvalue(), "ok") == ["1 yes"]
    assert "cannot start" in lines_of(out.getvalue(), "missing")[0]


def test_start_when_holds_a_command_back_until_its_condition(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    out = io.StringIO()
    first = f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(flag)!r}).touch(); print('ready')"
    second = f"import pathlib; print('saw flag', pathlib.Path({str(flag)!r}).exists())"
    codes = launch({"first": [PY, "-c", first], "second": [PY, "-c", second]}, out=out,
                   start_when={"second": flag.exists})
    assert codes == {"first": 0, "second": 0}
    assert lines_of(out.getvalue(), "second") == ["saw flag True"]


def test_start_when_gives_up_when_an_earlier_command_exits() -> None:
    out = io.StringIO()
    codes = launch({"first": [PY, "-c", "raise SystemExit(4)"], "second": [PY, "-c", "print('started')"]},
                   out=out, start_when={"second": lambda: False}, start_timeout_s=60)
    assert codes == {"first": 4, "second": 0}
    assert lines_of(out.getvalue(), "second") == ["started"]


def test_exit_code_helper() -> None:
    assert launch_exit_code({}) == 0
    assert launch_exit_code({"a": 0, "b": 0}) == 0
    assert launch_exit_code({"a": 0, "b": 3, "c": 4}) == 3
    assert launch_exit_code({"a": -15, "b": 3}) == 1
    assert launch_exit_code([0, 0, 2]) == 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no command named 'c'"):
        launch({"a": [PY, "-c", "pass"]}, stop_others_on_failure=["c"])
    with pytest.raises(ValueError, match="non-empty argv"):
        launch({"a": []})
    with pytest.raises(ValueError, match="non-empty argv"):
        launch({"a": "python -c pass"})


# --- stopping the others ---------------------------------------------------------------------


def test_failure_stops_the_others_quickly(leftovers: list[int], tmp_path: Path) -> None:
    """The trainer fails once the others are up (``stubborn`` ignoring SIGTERM): they are stopped, the
    one that ignores SIGTERM by SIGKILL after the grace time."""
    out = io.StringIO()
    ready = [str(tmp_path / "sidecar"), str(tmp_path / "stubborn")]
    fail = ("import os, sys, time\nwhile not all(map(os.path.exists, sys.argv[1:])): time.sleep(0.02)\n"
            "print('boom', flush=True)\nraise SystemExit(2)")
    start = time.monotonic()
    codes = launch(
        {
            "trainer": [PY, "-c", fail, *ready],
            "sidecar": [PY, "-c", SLEEPER, f"ready={ready[0]}"],
            "stubborn": [PY, "-c", SLEEPER, "ignore-term", f"ready={ready[1]}"],
        },
        stop_others_on_failure=["trainer"], grace_s=0.5, out=out,
    )
    assert time.monotonic() - start < 10
    assert codes == {"trainer": 2, "sidecar": -signal.SIGTERM, "stubborn": -signal.SIGKILL}
    launcher = lines_of(out.getvalue(), "launch")
    assert launcher[0] == "trainer exited with code 2; stopping sidecar, stubborn"
    assert "stubborn still running" in launcher[1]
    pids = [int(lines_of(out.getvalue(), n)[0].split()[1]) for n in ("sidecar", "stubborn")]
    leftovers.extend(pids)
    assert wait_gone(pids) == []


def test_a_listed_command_that_cannot_start_stops_the_others() -> None:
    out = io.StringIO()
    codes = launch({"trainer": ["/nonexistent/cadence-trainer"], "sidecar": [PY, "-c", SLEEPER]},
                   stop_others_on_failure=["trainer"], grace_s=5, out=out)
    assert codes == {"trainer": 127, "sidecar": -signal.SIGTERM}
    assert "trainer exited with code 127; stopping sidecar" in lines_of(out.getvalue(), "launch")


def test_failure_of_an_unlisted_process_stops_nothing() -> None:
    codes = launch(
        {"sidecar": [PY, "-c", "raise SystemExit(1)"],
         "trainer": [PY, "-c", "import time; time.sleep(0.5)"]},
        stop_others_on_failure=["trainer"], out=io.StringIO(),
    )
    assert codes == {"sidecar": 1, "trainer": 0}


def test_processes_left_behind_are_stopped(leftovers: list[int]) -> None:
    # "parent" exits at once but leaves a grandchild holding its output pipe: launch must neither
    # hang on the pipe nor leave the grandchild running.
    out = io.StringIO()
    start = time.monotonic()
    codes = launch({"parent": [PY, "-c", PARENT, "exit"]}, grace_s=2, out=out)
    assert time.monotonic() - start < 8
    assert codes == {"parent": 0}
    pids = [int(line.split()[1]) for line in lines_of(out.getvalue(), "parent")]
    leftovers.extend(pids)
    assert len(pids) == 2
    assert wait_gone(pids) == []
    assert "parent left processes behind" in lines_of(out.getvalue(), "launch")[0]


# --- signals to the launcher: no orphans -----------------------------------------------------

LAUNCHER = textwrap.dedent("""
    import json, sys
    from cadence.cluster.launch import launch, launch_exit_code
    commands, grace = json.loads(sys.argv[1]), float(sys.argv[2])
    sys.exit(launch_exit_code(launch(commands, grace_s=grace)))
""")


def start_launcher(commands: dict[str, list[str]], grace_s: float,
                   leftovers: list[int]) -> tuple[subprocess.Popen, queue.Queue]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([PY, "-c", LAUNCHER, json.dumps(commands), str(grace_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    leftovers.append(proc.pid)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def read_pids(lines: queue.Queue, count: int, leftovers: list[int],
              timeout: float = 8.0) -> dict[str, list[int]]:
    """The pids the launcher's children print, by child name, once ``count`` have been read."""
    pids: dict[str, list[int]] = {}
    seen = []
    deadline = time.monotonic() + timeout
    while sum(map(len, pids.values())) < count:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        assert line is not None, f"launcher ended early: {seen}"
        seen.append(line)
        match = re.match(r"\[(\w+)\] pid (\d+)$", line)
        if match:
            pids.setdefault(match.group(1), []).append(int(match.group(2)))
            leftovers.append(int(match.group(2)))
    return pids


def drain(lines: queue.Queue) -> list[str]:
    got = []
    while True:
        line = lines.get(timeout=5)
        if line is None:
            return got
        got.append(line)


def test_sigterm_to_the_launcher_stops_children_and_grandchildren(leftovers: list[int]) -> None:
    commands = {"trainer": [PY, "-c", PARENT], "stubborn": [PY, "-c", SLEEPER, "ignore-term"]}
    proc, lines = start_launcher(commands, grace_s=0.5, leftovers=leftovers)
    by_name = read_pids(lines, 3, leftovers)  # trainer, its grandchild, stubborn
    pids = by_name["trainer"] + by_name["stubborn"]
    assert len(pids) == 3
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=8) == 1  # children ended by signals
    assert time.monotonic() - start < 8
    assert wait_gone(pids) == []
    rest = drain(lines)
    assert "[launch] received SIGTERM; stopping trainer, stubborn" in rest
    assert any(line.startswith("[launch] stubborn still running 0.5 s after SIGTERM") for line in rest)


def test_second_sigint_kills_at_once(leftovers: list[int]) -> None:
    commands = {"a": [PY, "-c", SLEEPER, "ignore-term"], "b": [PY, "-c", SLEEPER]}
    proc, lines = start_launcher(commands, grace_s=30.0, leftovers=leftovers)
    by_name = read_pids(lines, 2, leftovers)
    pids = by_name["a"] + by_name["b"]
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert wait_gone(by_name["b"]) == []  # b honours the first signal's SIGTERM, a ignores it
    assert alive(by_name["a"][0])
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=8) == 1
    assert time.monotonic() - start < 8  # not the 30 s grace
    assert wait_gone(pids) == []
    assert "[launch] received SIGINT again; killing a" in drain(lines)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_killed_launcher(leftovers: list[int]) -> None:
    commands = {"a": [PY, "-c", SLEEPER], "b": [PY, "-c", SLEEPER]}
    proc, lines = start_launcher(commands, grace_s=1.0, leftovers=leftovers)
    pids = [pid for found in read_pids(lines, 2, leftovers).values() for pid in found]
    proc.kill()
    proc.wait(timeout=5)
    assert wait_gone(pids) == []


# --- the sidecar pair ------------------------------------------------------------------------


def test_sidecar_commands() -> None:
    cmds = sidecar_commands("exp.yaml", "runs/a", ["trainer.train_steps=10", "task.params.n=5"], python="py")
    sets = ["--set", "trainer.train_steps=10", "--set", "task.params.n=5"]
    assert cmds == {
        "trainer": ["py", "-m", "cadence", "train", "exp.yaml", "--model-dir", "runs/a", *sets,
                    "--set", "trainer.in_process_validation=false", "--no-progress"],
        "sidecar": ["py", "-m", "cadence", "evaluate", "exp.yaml", "--model-dir", "runs/a", *sets,
                    "--continuous"],
    }
    assert sidecar_commands(Path("c.yaml"), "m", [])["trainer"][:7] == [
        sys.executable, "-m", "cadence", "train", "c.yaml", "--model-dir", "m"]
    with pytest.raises(ConfigError, match="model_dir: not set"):
        sidecar_commands("c.yaml", "", [])
    sharded = sidecar_commands("c.yaml", "m", [], python="py", nproc=2)
    assert sharded["trainer"][-2:] == ["--nproc", "2"] and "--nproc" not in sharded["sidecar"]
