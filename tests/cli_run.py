"""Starting processes as a user does, for the process tier: ``python -m cadence`` (:func:`run_cadence`,
:func:`popen`) and torchrun jobs (:func:`run_torchrun`), one torch thread per process, this checkout's
sources first on the path. ``ROOT`` is the checkout, ``TESTS`` the folder of the tests' helper modules
(tasks, workers) that the processes load by path.

The commands are forked from a :mod:`zygote` (a fork server that has imported torch and cadence once,
one per pytest worker): each is a real process with its own pid, stdio, signals and exit status,
without the ~4 s of CPU that importing torch costs a fresh interpreter. ``CADENCE_TEST_FORK=0`` starts
every command as a fresh interpreter instead (as does an environment that changes what torch or
Python read at start-up, see :data:`zygote.STARTUP_ENV_PREFIXES`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
"""The environment of the processes: the caller's, one torch thread, this checkout's ``src``, a
console 200 columns wide (so that no log line a test looks for is wrapped)."""

FORK = os.environ.get("CADENCE_TEST_FORK", "1") != "0"
"""Whether commands are forked from the zygote (``CADENCE_TEST_FORK=0``: fresh interpreters)."""


class ForkedProcess:
    """A command forked by the :mod:`zygote`: the part of :class:`subprocess.Popen` the tests use
    (``pid``, ``returncode``, ``stdout``/``stderr`` when piped, ``poll``, ``wait``, ``communicate``,
    ``send_signal``, ``terminate``, ``kill``, a context manager)."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int,
                 stdout: IO[Any] | None = None, stderr: IO[Any] | None = None) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self._conn = conn
        self._lock = threading.Lock()

    def _receive(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
            self._conn.close()  # the zygote reaps the child now
            return self.returncode

    def poll(self) -> int | None:
        return self._receive(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._receive(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        assert input is None, "a forked process has no stdin pipe"
        out: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: out.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        return out.get("stdout"), out.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a zombie until the connection closes: the pid is never another's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


class _Zygote:
    """This process's fork server, started at its first use, ended with this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._path = ""

    def _started(self) -> str:
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

    def fork(self, argv: list[str], env: dict[str, str], cwd: str | os.PathLike | None,
             stdio: tuple[int, int, int], new_session: bool) -> tuple[socket.socket, int]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self._started())
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "new_session": new_session}
        socket.send_fds(conn, [json.dumps(request).encode()], list(stdio))
        return conn, json.loads(conn.recv(4096))["pid"]


_ZYGOTE = _Zygote()


def _forkable(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``python ARGV`` with ``env`` can be forked from the zygote (see :mod:`zygote`)."""
    from zygote import STARTUP_ENV_PREFIXES

    if not FORK or not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c")):
        return False
    changed = {k for k in env.keys() | ENV.keys() if env.get(k) != ENV.get(k)}
    return not any(k.startswith(STARTUP_ENV_PREFIXES) for k in changed)


def _fd(stream: Any, default: int, opened: list[int]) -> int:
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    return stream if isinstance(stream, int) else stream.fileno()


def popen(argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, start_new_session: bool = False,
          ) -> ForkedProcess | subprocess.Popen:
    """``python ARGV...`` started as :class:`subprocess.Popen` would (``env`` is the whole environment,
    default :data:`ENV`; ``stdout``/``stderr``: None, ``PIPE``, ``DEVNULL``, ``STDOUT`` or a file),
    forked from the zygote where it can be (:class:`ForkedProcess`), else a fresh interpreter."""
    env = dict(ENV if env is None else env)
    if not _forkable(argv, env):
        return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                                text=text, start_new_session=start_new_session)
    opened: list[int] = []
    readers: dict[str, IO[Any]] = {}
    fds = []
    for name, stream, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
        if stream == subprocess.PIPE:
            r, w = os.pipe()
            opened.append(w)
            readers[name] = open(r, "r" if text else "rb")  # noqa: SIM115 (the process's stream)
            fds.append(w)
        elif stream == subprocess.STDOUT:
            fds.append(fds[0])
        else:
            fds.append(_fd(stream, default, opened))
    stdin = os.open(os.devnull, os.O_RDONLY)
    opened.append(stdin)
    try:
        conn, pid = _ZYGOTE.fork(argv, env, cwd, (stdin, fds[0], fds[1]), start_new_session)
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedProcess([sys.executable, *argv], conn, pid, readers.get("stdout"), readers.get("stderr"))


def run_python(argv: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
               cwd: str | os.PathLike | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python ARGV...`` to completion, output captured as text (as ``subprocess.run(...,
    capture_output=True, text=True)``), forked from the zygote where it can be; ``env`` is the whole
    environment (default :data:`ENV`); past ``timeout`` it is killed and ``TimeoutExpired`` raised.
    Other keywords (``preexec_fn``, ``input``...) go to ``subprocess.run``, in a fresh interpreter."""
    if kwargs:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=ENV if env is None else env,
                              timeout=timeout, cwd=cwd, **kwargs)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(argv, env=env, cwd=cwd, stdout=out, stderr=err)
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


def torchrun_command(nproc: int, *args: str, tee: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node NPROC [--tee T] ARGS...``: a
    one-node job whose rendezvous port torchrun binds itself (port 0), so parallel jobs never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *(["--tee", str(tee)] if tee is not None else []), *args]


def run_torchrun(nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 180,
                 tee: int | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`torchrun_command` to completion, output captured as text; ``env`` adds to :data:`ENV`."""
    return run_python(torchrun_command(nproc, *args, tee=tee)[1:], env={**ENV, **(env or {})}, timeout=timeout,
                      **kwargs)


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
