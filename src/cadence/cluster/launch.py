"""Run several commands side by side -- ``cadence launch CONFIG --sidecar`` starts a trainer and its
sidecar evaluator this way -- with their output merged line by line and no process left behind.

Each command runs in its own session (so its own process group: a signal to the group reaches
the grandchildren too, e.g. torchrun's workers), with stdout and stderr merged into one pipe.
Every line it writes is copied to ``out`` as ``[name] line``, whole lines only. The launcher waits
for all of them; when one named in ``stop_others_on_failure`` fails, the others are stopped
(SIGTERM, then SIGKILL after ``grace_s``). SIGINT, SIGTERM or SIGHUP to the launcher stop them all
the same way (a second signal kills at once), and on Linux each child also gets SIGTERM if the
launcher dies without cleaning up (``PR_SET_PDEATHSIG``).

No torch here, and no rich: plain lines, flushed one at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from cadence.layout import require_model_dir
from cadence.runtime.parent_death import parent_death_signal_setter
from cadence.runtime.signals import install_handlers, signal_name

__all__ = ["launch", "launch_exit_code", "sidecar_commands"]

_POLL_S = 0.05
_LAUNCHER = "launch"  # the prefix of the launcher's own messages
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def sidecar_commands(
    config_path: str | os.PathLike[str],
    model_dir: str,
    overrides: Sequence[str] = (),
    python: str = sys.executable,
    *,
    nproc: int | None = None,
    sidecar_nproc: int | None = None,
    progress: bool = False,
) -> dict[str, list[str]]:
    """The two commands of ``cadence launch CONFIG --sidecar``: a continuous evaluator, and a
    trainer that does not validate in-process, on the same model dir (in that order); ``nproc``:
    the trainer runs on that many processes (``cadence train --nproc``); ``sidecar_nproc``: the
    sidecar does (``cadence evaluate --continuous --nproc``; default one process);
    ``progress``: the trainer prints its progress lines (else ``cadence train --no-progress``; the
    sidecar prints none either way).

    Raises:
      ConfigError: ``model_dir`` is empty (both processes must agree on it).
    """
    model_dir = require_model_dir(model_dir)
    config = os.fspath(config_path)
    sets = [arg for text in overrides for arg in ("--set", text)]
    common = [config, "--model-dir", os.fspath(model_dir), *sets]
    return {  # the sidecar first: the trainer may start once it holds its lease
        "sidecar": [python, "-m", "cadence", "evaluate", *common, "--continuous",
                    *(["--nproc", str(sidecar_nproc)] if sidecar_nproc is not None else [])],
        "trainer": [python, "-m", "cadence", "train", *common,
                    "--set", "trainer.in_process_validation=false", *([] if progress else ["--no-progress"]),
                    *(["--nproc", str(nproc)] if nproc is not None else [])],
    }


def launch_exit_code(codes: Mapping[str, int] | Sequence[int]) -> int:
    """One exit status for the launcher: 0 if every code is 0, else the first non-zero code in
    order, with 1 for a process killed by a signal (a negative code)."""
    values = codes.values() if isinstance(codes, Mapping) else codes
    for code in values:
        if code != 0:
            return 1 if code < 0 else code
    return 0


@dataclass
class _Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    returncode: int | None = None
    kill_at: float | None = None  # SIGTERM sent; SIGKILL at this monotonic time
    killed: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    @property
    def started(self) -> subprocess.Popen[bytes]:
        """The child's process; only for a child that was started (``proc`` set)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc


@dataclass
class _Output:
    """Writes whole prefixed lines to ``out``, one writer at a time."""

    out: IO[str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    broken: bool = False

    def line(self, name: str, text: str) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.out.write(f"[{name}] {text}\n")
                self.out.flush()
            except (OSError, ValueError):  # closed or broken pipe: keep draining the children
                self.broken = True


def launch(
    commands: Mapping[str, Sequence[str]],
    *,
    env: Mapping[str, str] | None = None,
    stop_others_on_failure: Sequence[str] = (),
    grace_s: float = 30.0,
    out: IO[str] | None = None,
    start_when: Mapping[str, Callable[[], bool]] | None = None,
    start_timeout_s: float = 300.0,
) -> dict[str, int]:
    """Start every command, stream their output to ``out``, wait until all have exited.

    Args:
      commands: name -> argv, started in this order.
      env: variables added to this process's environment for every child (``PYTHONUNBUFFERED=1``
        is set unless given, so Python children's lines arrive as they are printed).
      stop_others_on_failure: names of commands whose non-zero exit stops all the others.
      grace_s: seconds between SIGTERM and SIGKILL when stopping a command.
      out: where the lines go (default ``sys.stdout``).
      start_when: name -> condition: that command starts only once its condition is true (polled
        every 0.1 s), or an earlier command has exited, or ``start_timeout_s`` has passed (then
        it starts anyway, with a line saying so). E.g. the trainer waits for the sidecar's lease.

    Returns:
      ``{name: returncode}`` in the order of ``commands``; negative ``-N``: killed by signal N;
      127: the command could not be started (the reason is printed as one of its lines).

    Signal handlers for SIGINT / SIGTERM / SIGHUP are installed for the duration of the call when
    it runs in the main thread (and restored afterwards): the first such signal stops every child
    (SIGTERM, then SIGKILL after ``grace_s``), a second kills them at once.
    """
    out = sys.stdout if out is None else out
    names = list(commands)
    unknown = [n for n in stop_others_on_failure if n not in commands]
    if unknown:
        raise ValueError(f"stop_others_on_failure: no command named {', '.join(map(repr, unknown))}")
    for name, argv in commands.items():
        if isinstance(argv, str) or not argv:
            raise ValueError(f"command {name!r}: expected a non-empty argv list, got {argv!r}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")

    child_env = dict(os.environ)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.update(env or {})
    output = _Output(out)
    children = [_Child(name, [os.fspath(a) for a in commands[name]]) for name in names]
    signals: list[int] = []
    handlers = install_handlers(_STOP_SIGNALS, lambda signum, _frame: signals.append(signum), owner="cadence launch")
    try:
        # All processes first, then the reader threads: no thread of ours runs while forking.
        for child in children:
            if signals:
                break
            condition = (start_when or {}).get(child.name)
            if condition is not None:
                _wait_for(condition, child.name, children, signals, start_timeout_s, output)
                if signals:
                    break
            _start(child, child_env, output)
        for child in children:
            _start_reader(child, output)
        _supervise(children, set(stop_others_on_failure), grace_s, signals, output)
    finally:
        try:
            _cleanup(children, grace_s, output)
        finally:
            handlers.restore()
    # A command not started because a stop signal came first counts as stopped by that signal.
    not_started = -(signals[0] if signals else signal.SIGTERM)
    return {c.name: (c.returncode if c.returncode is not None else not_started) for c in children}


def _wait_for(condition: Callable[[], bool], name: str, children: list[_Child], signals: list[int],
              timeout_s: float, output: _Output) -> None:
    deadline = time.monotonic() + timeout_s
    while not signals:
        if condition():
            return
        if any(c.proc is not None and c.proc.poll() is not None for c in children):
            return  # an earlier command ended: start anyway, the supervisor reports it
        if time.monotonic() >= deadline:
            output.line(_LAUNCHER, f"starting {name} after waiting {timeout_s:g} s for its start condition")
            return
        time.sleep(0.1)


def _start(child: _Child, env: Mapping[str, str], output: _Output) -> None:
    try:
        child.proc = subprocess.Popen(
            child.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, close_fds=True, preexec_fn=die_with_parent(),
        )
    except OSError as exc:
        output.line(child.name, f"cannot start {child.argv[0]!r}: {exc}")
        child.returncode = 127


def _start_reader(child: _Child, output: _Output) -> None:
    """The thread that copies a started ``child``'s lines to ``output`` (nothing for one that did not start)."""
    if child.proc is not None:
        child.reader = threading.Thread(target=_pump, args=(child.proc.stdout, child.name, output),
                                        name=f"cadence-launch-{child.name}", daemon=True)
        child.reader.start()


def _pump(stream: IO[bytes], name: str, output: _Output) -> None:
    with stream:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", errors="replace")
            output.line(name, text.removesuffix("\n").removesuffix("\r"))


def _supervise(children: list[_Child], stoppers: set[str], grace_s: float,
               signals: list[int], output: _Output, restart: Callable[[_Child], bool] | None = None) -> None:
    """Wait for ``children``: a non-zero exit of one in ``stoppers`` stops the others; the stop
    ``signals`` stop (then kill) them all. ``restart``: asked about a child that exited non-zero
    before any stop signal; True when it started the child again (nothing else is done then)."""

    def exited(child: _Child) -> None:
        code = child.returncode
        if code is not None and code != 0 and child.name in stoppers:
            others = [c for c in children if c.running]
            if others:
                output.line(_LAUNCHER, f"{child.name} exited with {_describe(code)}; "
                                       f"stopping {', '.join(c.name for c in others)}")
            for other in others:
                _terminate(other, grace_s)

    for child in children:
        if child.proc is None and child.returncode is not None:  # could not start
            exited(child)
    handled_signals = 0
    while any(c.running for c in children):
        now = time.monotonic()
        for child in children:
            if child.running and child.started.poll() is not None:
                child.returncode = child.started.returncode
                if restart is not None and child.returncode != 0 and not signals and restart(child):
                    continue
                exited(child)
        if len(signals) > handled_signals:
            first = handled_signals == 0
            handled_signals = len(signals)
            name = signal_name(signals[-1])
            running = [c for c in children if c.running]
            if first:
                output.line(_LAUNCHER, f"received {name}; stopping {', '.join(c.name for c in running)}")
                for child in running:
                    _terminate(child, grace_s)
            else:
                output.line(_LAUNCHER, f"received {name} again; killing {', '.join(c.name for c in running)}")
                for child in running:
                    _kill(child)
        for child in children:
            if child.running and child.kill_at is not None and not child.killed and now >= child.kill_at:
                output.line(_LAUNCHER, f"{child.name} still running {grace_s:g} s after SIGTERM; killing it")
                _kill(child)
        time.sleep(_POLL_S)


def _cleanup(children: list[_Child], grace_s: float, output: _Output) -> None:
    """Make sure nothing is left: running children (after an error in the launcher itself) and
    leftover members of finished children's process groups are terminated, then killed."""
    for child in children:
        if child.running:
            _terminate(child, grace_s)
    for child in children:
        if child.proc is None:
            continue
        if child.running:
            timeout = max(0.0, (child.kill_at or time.monotonic()) - time.monotonic())
            try:
                child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill(child)
            child.returncode = child.proc.wait()
        # The leader has exited; anything left in its group is an orphan in the making.
        if _group_alive(child.proc.pid):
            output.line(_LAUNCHER, f"{child.name} left processes behind; stopping them")
            _signal_group(child.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while _group_alive(child.proc.pid) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            _signal_group(child.proc.pid, signal.SIGKILL)
        if child.reader is not None:
            child.reader.join(timeout=5.0)


def _terminate(child: _Child, grace_s: float) -> None:
    if child.kill_at is None:
        child.kill_at = time.monotonic() + grace_s
        _signal_group(child.started.pid, signal.SIGTERM)


def _kill(child: _Child) -> None:
    child.killed = True
    _signal_group(child.started.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a live member (zombies awaiting their reaper are dead)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: the signal test is all there is
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def die_with_parent() -> Callable[[], None] | None:
    """On Linux: a preexec function that makes the child get SIGTERM when the launcher dies
    without stopping it (SIGKILL, a crash). SIGTERM, not SIGKILL: a trainer can still save."""
    set_death_signal = parent_death_signal_setter(signal.SIGTERM)
    if set_death_signal is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        set_death_signal()
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _describe(code: int) -> str:
    return f"signal {signal_name(-code)}" if code < 0 else f"code {code}"
