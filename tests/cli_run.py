"""Starting processes as a user does, for the process tier: ``python -m cadence`` (:func:`run_cadence`,
:func:`popen`) and torchrun jobs (:func:`run_torchrun`), one torch thread per process, this checkout's
sources first on the path. ``ROOT`` is the checkout, ``TESTS`` the folder of the tests' helper modules
(tasks, workers) that the processes load by path.

The commands are forked from a :mod:`zygote` (a fork server that has imported torch and cadence once,
one per pytest worker), and so are the Python processes they start (torchrun's agent and ranks,
``cadence launch``'s children, a sweep's trials): each is a real process with its own pid, stdio,
signals and exit status, without the ~4 s of CPU that importing torch costs a fresh interpreter.
``CADENCE_TEST_FORK=0`` starts every command as a fresh interpreter instead (as does an environment
that changes what torch or Python read at start-up, see :data:`zygote.STARTUP_ENV_PREFIXES`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import zygote

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200",
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""The environment of the processes: the caller's, one torch thread, this checkout's ``src``, a
console 200 columns wide (so that no log line a test looks for is wrapped), Hugging Face's libraries
offline (nothing is downloaded: they read these when imported, in the zygote too)."""


class _Zygote:
    """This process's fork server, started at its first use, ended with this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._path = ""

    def socket_path(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._path = os.path.join(tempfile.mkdtemp(prefix="cadence-zygote-"), "socket")
                self._proc = subprocess.Popen([sys.executable, str(TESTS / "zygote.py"), self._path],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV, cwd=ROOT)
                assert self._proc.stdout is not None
                if self._proc.stdout.readline().strip() != b"ready":
                    raise RuntimeError("the test zygote did not start")
                atexit.register(self._proc.stdin.close)  # type: ignore[union-attr]
            return self._path


zygote.use(_Zygote().socket_path, ENV)


def popen(argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, start_new_session: bool = False,
          stdin: Any = subprocess.DEVNULL, **kwargs: Any) -> subprocess.Popen:
    """``python ARGV...`` started as :class:`subprocess.Popen` would (``env`` is the whole environment,
    default :data:`ENV`; stdin ``/dev/null`` unless given), forked from the zygote where it can be
    (:class:`zygote.ZygotePopen`), else a fresh interpreter."""
    return zygote.ZygotePopen([sys.executable, *argv], stdin=stdin, stdout=stdout, stderr=stderr,
                              env=dict(ENV if env is None else env), cwd=cwd, text=text,
                              start_new_session=start_new_session, **kwargs)


def run_python(argv: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
               cwd: str | os.PathLike | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python ARGV...`` to completion, output captured as text (as ``subprocess.run(...,
    capture_output=True, text=True)``), forked from the zygote where it can be; ``env`` is the whole
    environment (default :data:`ENV`); past ``timeout`` it is killed and ``TimeoutExpired`` raised.
    Other keywords go to :func:`popen`. The output goes through files, not pipes: a process it leaves
    behind cannot hold the call up."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, **kwargs)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout or 0, _read(out), _read(err)) from None
        return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, _read(out), _read(err))


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode().replace("\r\n", "\n").replace("\r", "\n")


def run_cadence(*args: str, env: dict[str, str] | None = None, timeout: float = 300, check: bool = False,
                **kwargs: Any) -> subprocess.CompletedProcess:
    """``cadence ARGS...`` to completion, output captured as text; ``env`` adds to :data:`ENV`,
    ``check`` asserts exit status 0 (the message is the output), other keywords go to ``subprocess.run``."""
    proc = run_python(["-m", "cadence", *args], env={**ENV, **(env or {})}, timeout=timeout, **kwargs)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def torchrun_command(nproc: int, *args: str, tee: int | None = None, external: bool = False) -> list[str]:
    """``python -m cadence.cli.torchrun_agent --standalone --nproc-per-node NPROC [--tee T] ARGS...``: a
    one-node job whose rendezvous port torchrun binds itself (port 0), so parallel jobs never collide.

    The agent is torchrun's launcher as ``cadence train --nproc`` runs it (torch's ``main``, with its workers
    ending with it and torch's rendezvous events named cheaply: torch's own agent spends about a third more
    CPU on a test's job). ``external``: ``python -m torch.distributed.run``, torch's own, for the tests of a
    job under a torchrun that is not cadence's."""
    launcher = "torch.distributed.run" if external else "cadence.cli.torchrun_agent"
    return [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", str(nproc),
            *(["--tee", str(tee)] if tee is not None else []), *args]


def run_torchrun(nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 180,
                 tee: int | None = None, external: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`torchrun_command` to completion, output captured as text; ``env`` adds to :data:`ENV`."""
    return run_python(torchrun_command(nproc, *args, tee=tee, external=external)[1:], env={**ENV, **(env or {})},
                      timeout=timeout, **kwargs)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def reaped(pid: int) -> bool:
    """Whether ``pid`` has ended and been reaped: a zombie still answers ``kill(pid, 0)``, as the writer
    lease's check of its holder does."""
    return not Path(f"/proc/{pid}").exists()


def kill_job(job: subprocess.Popen, ranks: list[int], timeout: float = 30.0) -> None:
    """The whole job at once, as a machine dies: SIGKILL to each of ``ranks`` (torchrun starts each in
    a session of its own), then to ``job``'s process group (cadence and torchrun's agent); returns
    once the job has exited and every rank is reaped (the writer lease checks its holder's pid)."""
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while not all(reaped(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived SIGKILL"
        time.sleep(0.02)


def killed_after(config: Path, model_dir: Path, step: int, last: int, *extra: str) -> None:
    """``cadence train CONFIG --model-dir MODEL_DIR EXTRA...`` with each step slowed (the Task's
    ``step_sleep``, 0.05 s) and its ranks' pids written (the Task's ``pid_dir``: TinyTask's), killed
    with every rank (:func:`kill_job`) a few steps after ``ckpt-STEP`` is committed: those steps are
    lost, to be redone. Asserts ``ckpt-STEP`` committed and ``ckpt-LAST`` not reached."""
    pids = model_dir.parent / "pids"
    pids.mkdir(exist_ok=True)
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(model_dir), "--no-progress",
                  "--set", "task.params.step_sleep=0.05", "--set", f"task.params.pid_dir={pids}", *extra],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    manifest = model_dir / "checkpoints" / f"ckpt-{step}" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a few steps past the checkpoint: lost, and redone exactly
    kill_job(proc, [int(p.read_text()) for p in pids.iterdir()])
    assert manifest.exists() and not (model_dir / "checkpoints" / f"ckpt-{last}").exists()


def checkpoint_weights(checkpoint: Path) -> dict[str, Any]:
    """The full model state of checkpoint directory ``checkpoint``: its ``model.safetensors``,
    or assembled from the ranks' shards of a sharded (FSDP) checkpoint."""
    from safetensors.torch import load_file

    from cadence.torch.checkpoint_io.sharded import read_model_state

    plain = checkpoint / "model.safetensors"
    return load_file(plain) if plain.exists() else read_model_state(str(checkpoint))


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical state dicts: the same keys, each tensor equal in dtype, shape and every bit."""
    import torch

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)
