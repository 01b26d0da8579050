"""``cadence launch CONFIG --replicas R``: fault-tolerant replica groups on one machine.

Starts torchft's lighthouse (its ``torchft_lighthouse`` program, on a free port of 127.0.0.1, its log
in ``MODEL_DIR/replicas/lighthouse.log``), then R groups, each a ``cadence train`` job (of one process,
or ``cadence train --nproc N``: torch's launcher with a rendezvous of its own on a free port) with its
``trainer.fault_tolerance.replica_id`` and the lighthouse's address, all with the same model dir: the
run's checkpoints are ``MODEL_DIR/checkpoints``, committed by the group whose chief holds the writer
lease (group 0 at first; a survivor when it dies), and group ``r > 0`` writes its own outputs into
``MODEL_DIR/replicas/group<r>`` (:func:`cadence.layout.replica_group_dir`). A group that dies (a
non-zero exit but 2, a signal) is started again, at most ``max_restarts`` times; it heals from a live
peer at its first step. A group that exits with code 2 was refused (bad input) and is not. Their output is streamed
as ``[group<r>] line`` (:mod:`cadence.cluster.launch`); each group's process gets
``CADENCE_REPLICA_ID=<r>`` too. Once every group has ended, the lighthouse is stopped. SIGINT / SIGTERM /
SIGHUP stop everything (SIGTERM, then SIGKILL after ``grace_s``).

No torch here: the lighthouse is a separate program.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from cadence.cluster.launch import (_LAUNCHER, _STOP_SIGNALS, _Child, _cleanup, _describe, _Output, _start,
                                    _start_reader, _supervise, die_with_parent)
from cadence.config.components.fault_tolerance import REPLICA_ID_ENV
from cadence.errors import ConfigError
from cadence.runtime.signals import install_handlers

__all__ = ["group_commands", "lighthouse_program", "run_replica_groups"]

LIGHTHOUSE_WAIT_S = 15.0
"""How long the launcher waits for the lighthouse to accept connections before it gives up (exit 2)."""


def lighthouse_program(python: str = sys.executable) -> str:
    """The ``torchft_lighthouse`` program beside ``python`` (or on ``PATH``); a :class:`ConfigError`
    naming the ``ft`` extra when there is none."""
    beside = Path(python).parent / "torchft_lighthouse"
    found = str(beside) if beside.is_file() else shutil.which("torchft_lighthouse")
    if found is None:
        raise ConfigError("launch --replicas: no torchft_lighthouse program (pip install 'cadence[ft]')")
    return found


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the lighthouse binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_commands(config_path: str | os.PathLike[str], model_dir: str, replicas: int, lighthouse: str,
                   overrides: Sequence[str] = (), python: str = sys.executable, *,
                   progress: bool = False, nproc: int = 1) -> dict[str, list[str]]:
    """``{"group<r>": argv}``: each group's ``cadence train`` of ``model_dir`` (every group the same),
    with ``trainer.fault_tolerance`` set to ``replicas`` groups, its id and the ``lighthouse`` address
    over the config's other settings; ``nproc`` > 1: each group
    ``--nproc nproc`` ranks (a standalone rendezvous each: the groups do not meet)."""
    sets = [arg for text in overrides for arg in ("--set", text)]
    commands = {}
    for r in range(replicas):
        ft = [f"trainer.fault_tolerance.replica_groups={replicas}", f"trainer.fault_tolerance.replica_id={r}",
              f"trainer.fault_tolerance.lighthouse={lighthouse}"]
        commands[f"group{r}"] = [python, "-m", "cadence", "train", os.fspath(config_path), "--model-dir", model_dir,
                                 *sets, *[a for text in ft for a in ("--set", text)],
                                 *([] if progress else ["--no-progress"]),
                                 *(["--nproc", str(nproc)] if nproc > 1 else [])]
    return commands


def run_replica_groups(commands: dict[str, list[str]], lighthouse_argv: list[str], lighthouse_port: int,
                       lighthouse_log: Path, *, max_restarts: int = 3, grace_s: float = 30.0,
                       out: IO[str] | None = None) -> dict[str, int]:
    """Start the lighthouse, wait until it accepts connections (a :class:`ConfigError` after
    :data:`LIGHTHOUSE_WAIT_S`, or when it exits), start every group, restart a group that dies (at most
    ``max_restarts`` times each; not one refused: exit code 2), stop the lighthouse once every group has ended.

    Returns ``{group: last exit code}`` (negative: a signal) and, under ``"restarts"``, the restarts
    made in all."""
    output = _Output(sys.stdout if out is None else out)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["COLUMNS"] = "120"
    env.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info
    lighthouse_log.parent.mkdir(parents=True, exist_ok=True)
    signals: list[int] = []
    handlers = install_handlers(_STOP_SIGNALS, lambda signum, _frame: signals.append(signum), owner="cadence launch")
    with open(lighthouse_log, "ab") as log_file:
        lighthouse = _Lighthouse(lighthouse_argv, log_file, env)
        groups = [_Child(name, argv) for name, argv in commands.items()]
        restarts = {child.name: 0 for child in groups}
        try:
            lighthouse.start_and_wait(lighthouse_port)
            output.line(_LAUNCHER, f"lighthouse on 127.0.0.1:{lighthouse_port} (log: {lighthouse_log})")
            for child in groups:
                _begin(child, env, output)
            _supervise(groups, set(), grace_s, signals, output,
                       restart=lambda child: _restart(child, restarts, max_restarts, env, output))
        finally:
            try:
                _cleanup(groups, grace_s, output)
            finally:
                lighthouse.stop()
                handlers.restore()
    codes = {c.name: (c.returncode if c.returncode is not None else -signal.SIGTERM) for c in groups}
    codes["restarts"] = sum(restarts.values())
    return codes


class _Lighthouse:
    def __init__(self, argv: list[str], log_file: IO[bytes], env: dict[str, str]) -> None:
        self.argv, self.log_file, self.env = argv, log_file, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start_and_wait(self, port: int) -> None:
        self.proc = proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log_file,
                                            stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                            preexec_fn=die_with_parent())
        deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
        while True:
            if proc.poll() is not None:
                raise ConfigError(f"launch --replicas: the lighthouse exited with code {proc.returncode} "
                                  f"before accepting connections (see {self.log_file.name})")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"launch --replicas: the lighthouse did not accept connections on "
                                      f"127.0.0.1:{port} within {LIGHTHOUSE_WAIT_S:g} s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _begin(child: _Child, env: dict[str, str], output: _Output) -> None:
    child.proc, child.returncode, child.kill_at, child.killed = None, None, None, False
    _start(child, {**env, REPLICA_ID_ENV: child.name.removeprefix("group")}, output)
    _start_reader(child, output)


def _restart(child: _Child, restarts: dict[str, int], max_restarts: int, env: dict[str, str],
             output: _Output) -> bool:
    """A group that died: started again while it has restarts left (True), else reported (False). A
    group that exited with code 2 was refused (bad input: a config its peers do not share, ...): the
    same again at each start, so it is not restarted."""
    if child.started.returncode == 2:
        output.line(_LAUNCHER, f"{child.name} was refused (code 2: bad input, see its error above); not restarting it")
        return False
    if restarts[child.name] >= max_restarts:
        output.line(_LAUNCHER, f"{child.name} exited with {_describe(child.started.returncode)}; no restart left "
                               f"({max_restarts} made)")
        return False
    restarts[child.name] += 1
    output.line(_LAUNCHER, f"{child.name} exited with {_describe(child.started.returncode)}; restarting it "
                           f"({restarts[child.name]} of {max_restarts})")
    if child.reader is not None:
        child.reader.join(timeout=5.0)
    _begin(child, env, output)
    return True
