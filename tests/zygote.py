"""A fork server for the process tier: one interpreter per pytest worker that has imported torch and
cadence once, and forks a child per command.

Starting ``python -m cadence`` costs about 4 s of CPU on these machines, nearly all of it importing
torch, and the process tier starts hundreds of them, many of which start more (torchrun's agent and
its ranks, ``cadence launch``'s children, a sweep's trials). A child forked from this server is a
real process (its own pid, its own stdio, real signals, ``kill -9``, its own exit status) that runs
the command exactly as ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` would, from an interpreter
whose ``sys.modules`` already holds what the command would import. The server does nothing else
before it forks: it imports, then waits.

:class:`ZygotePopen` is :class:`subprocess.Popen` for such commands: ``[sys.executable, ...]`` is
forked from the server where it can be (:func:`forkable`), and started as usual otherwise. The tests
use it (:mod:`cli_run`), and in every forked child it is what ``subprocess.Popen`` does (its methods
are swapped in the child), so that the processes a command starts are forked too. What a parent's
``Popen`` gives a child beyond its stdio is carried over: a new session (``start_new_session``);
cadence's ``PR_SET_PDEATHSIG`` (:func:`cadence.cluster.launch.die_with_parent`) becomes the server
sending that signal when the requester exits; a child without a session of its own, which would be in
its requester's process group, gets the signal that killed its requester (``os.killpg`` on that group).

A forked child's ``/proc/PID/cmdline`` is the server's (``python tests/zygote.py
/tmp/cadence-zygote-.../socket``), not its command's.

What a fresh interpreter reads from its environment while importing is read again in the child
(fsspec's ``FSSPEC_*`` configuration, ``tempfile``'s directory); ``-u`` and ``PYTHONUNBUFFERED`` make
the child's stdout and stderr write through. Other keys that torch, OpenMP or Python itself read at
start-up (:data:`STARTUP_ENV_PREFIXES`) cannot be read again: a command whose environment differs from
the server's in one of them is started as a plain process, as is every command whose environment
holds ``CADENCE_TEST_FORK=0``.

Protocol (``AF_UNIX``, ``SOCK_SEQPACKET``, one connection per child): the client sends one JSON
message ``{"argv": [...], "env": {...}, "cwd": ..., "new_session": bool, "requester": pid | None,
"death_signal": N | None}`` with three file descriptors (stdin, stdout, stderr); the server answers
``{"pid": N}``, and once the child has exited, ``{"returncode": R}`` (``-SIG`` when a signal ended it,
as :mod:`subprocess` reports it). The child stays a zombie until the client closes the connection, so
its pid is never reused while a client may still signal it. The server exits when its stdin closes
(its pytest worker is gone).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, ClassVar, Iterator

STARTUP_ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "CUBLAS",
                        "NCCL", "LD_", "MALLOC")
"""Environment keys read while torch or Python start: a command that changes one runs unforked."""

RUNTIME_ENV = ("PYTHONUNBUFFERED", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
"""Keys with a start-up prefix that nothing reads at start-up (torchrun's, for its ranks) or that the
child applies itself (``PYTHONUNBUFFERED``)."""

PRELOAD = ("torch", "numpy", "cadence", "torch._dynamo", "torch.distributed.launcher.api",
           "torch.distributed.checkpoint", "tensorboard.summary.writer.event_file_writer",
           "tensorboard.compat.proto.summary_pb2", "sklearn.datasets", "s3fs", "onnxscript", "optuna", "mlflow",
           "datasets", "transformers.models.gpt2.modeling_gpt2", "transformers.models.auto.tokenization_auto")
"""What the server imports before it forks: torch, every module of cadence (but ``__main__``), and what
cadence imports lazily that the tests' commands need (torch's compiler, which an optimizer imports;
torchrun; DCP; TensorBoard's event writer; scikit-learn's datasets for the digits example; s3fs, ONNX,
Optuna, MLflow; Hugging Face's datasets, GPT-2 and AutoTokenizer, 3.5 s, for the hf_gpt2 example).
Each would cost every command that uses it its import. Not inductor: importing it takes 2 s and only
the compile tests use it."""

MESSAGE = 1 << 20
_DIE_WITH_PARENT = ("cadence.cluster.launch", "die_with_parent.<locals>.preexec")
"""The ``preexec_fn`` that sets ``PR_SET_PDEATHSIG`` to SIGTERM (module, qualified name)."""


class _Server:
    """Where the server listens and the environment it started with; set in the server's children
    and, through :func:`use`, in the tests' process."""

    socket_path: ClassVar[Callable[[], str] | None] = None
    env: ClassVar[dict[str, str]] = {}


def use(socket_path: Callable[[], str], env: dict[str, str]) -> None:
    """Fork from the server at ``socket_path()`` (called at the first fork), started with ``env``."""
    _Server.socket_path, _Server.env = socket_path, dict(env)


def forkable(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``python ARGV`` with ``env`` can be forked from the server: ``-m``, ``-c`` or a script
    (after ``-u``), with no start-up key (:data:`STARTUP_ENV_PREFIXES`) changed from the server's."""
    if _Server.socket_path is None or env.get("CADENCE_TEST_FORK", "1") == "0":
        return False
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-m", "-c")):
        return False
    changed = {k for k in env.keys() | _Server.env.keys() if env.get(k) != _Server.env.get(k)}
    return not any(k.startswith(STARTUP_ENV_PREFIXES) and not k.startswith(RUNTIME_ENV) for k in changed)


def fork(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *, new_session: bool,
         requester: int | None = None, death_signal: int | None = None) -> tuple[socket.socket, int]:
    """Ask the server to fork ``python ARGV`` (see the protocol above): its connection and pid."""
    assert _Server.socket_path is not None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(_Server.socket_path())
    request = {"argv": argv, "env": env, "cwd": cwd, "new_session": new_session, "requester": requester,
               "death_signal": death_signal}
    socket.send_fds(conn, [json.dumps(request).encode()], list(stdio))
    return conn, json.loads(conn.recv(4096))["pid"]


def receive_returncode(conn: socket.socket, timeout: float | None) -> int | None:
    """The exit status the server reports on ``conn`` (closed then: the child is reaped), None if it
    is not there within ``timeout``; the server gone counts as SIGKILL."""
    conn.settimeout(timeout)
    try:
        data = conn.recv(4096)
    except (TimeoutError, BlockingIOError):
        return None
    conn.close()
    return json.loads(data)["returncode"] if data else -signal.SIGKILL


_POPEN = {name: subprocess.Popen.__dict__[name] for name in ("_execute_child", "_internal_poll", "_wait")}
_EXECUTE_CHILD = inspect.signature(_POPEN["_execute_child"])


class ZygotePopen(subprocess.Popen):
    """:class:`subprocess.Popen` that forks ``[sys.executable, ...]`` from the server where it can
    (:func:`forkable`, no ``pass_fds``, ``user``/``group``/``umask``/``process_group``, and no
    ``preexec_fn`` but cadence's ``die_with_parent``); other commands start as usual."""

    _zygote: socket.socket | None = None
    _zygote_lock: threading.Lock

    def _execute_child(self, *args: Any, **kwargs: Any) -> None:
        call = _EXECUTE_CHILD.bind(self, *args, **kwargs).arguments
        request = _request(call)
        if request is None:
            return _POPEN["_execute_child"](self, *args, **kwargs)
        p2cread, c2pwrite, errwrite = call["p2cread"], call["c2pwrite"], call["errwrite"]
        stdio = (0 if p2cread == -1 else p2cread, 1 if c2pwrite == -1 else c2pwrite, 2 if errwrite == -1 else errwrite)
        self._zygote_lock = threading.Lock()
        self._zygote, self.pid = fork(*request, stdio, new_session=bool(call["start_new_session"]),
                                      requester=os.getpid(),
                                      death_signal=_death_signal(call["preexec_fn"]))
        self._child_created = True
        self._close_pipe_fds(call["p2cread"], call["p2cwrite"], call["c2pread"], call["c2pwrite"],
                             call["errread"], call["errwrite"])

    def _internal_poll(self, *args: Any, **kwargs: Any) -> int | None:
        if self._zygote is None:
            return _POPEN["_internal_poll"](self, *args, **kwargs)
        return self._zygote_returncode(0)

    def _wait(self, timeout: float | None) -> int:
        if self._zygote is None:
            return _POPEN["_wait"](self, timeout)
        code = self._zygote_returncode(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def _zygote_returncode(self, timeout: float | None) -> int | None:
        assert self._zygote is not None
        with self._zygote_lock:
            if self.returncode is None:
                self.returncode = receive_returncode(self._zygote, timeout)
            return self.returncode


def forked(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` (a :class:`ZygotePopen`) was forked from the server."""
    return isinstance(proc, ZygotePopen) and proc._zygote is not None


def _request(call: dict[str, Any]) -> tuple[list[str], dict[str, str], str] | None:
    """``(argv, env, cwd)`` of a ``Popen`` call the server can fork, else None."""
    args, env = call["args"], call["env"]
    if isinstance(args, (str, bytes)) or call["shell"] or call["pass_fds"]:
        return None
    args = [os.fspath(a) for a in args]
    if not args or call["executable"] not in (None, args[0]) or os.path.abspath(args[0]) != sys.executable:
        return None
    if any(call.get(k) not in (None, -1) for k in ("gid", "gids", "uid", "umask", "process_group")):
        return None
    if call["preexec_fn"] is not None and _death_signal(call["preexec_fn"]) is None:
        return None
    env = dict(os.environ if env is None else env)
    if not all(isinstance(v, str) and isinstance(k, str) for k, v in env.items()):
        return None
    if not forkable(args[1:], env):
        return None
    return args[1:], env, os.fspath(call["cwd"] or os.getcwd())


def _death_signal(preexec_fn: Any) -> int | None:
    """SIGTERM for cadence's ``die_with_parent`` preexec function (``PR_SET_PDEATHSIG``), else None."""
    if preexec_fn is not None and (preexec_fn.__module__, preexec_fn.__qualname__) == _DIE_WITH_PARENT:
        return int(signal.SIGTERM)
    return None


@contextlib.contextmanager
def forking_children() -> Iterator[None]:
    """While in this block, ``subprocess.Popen`` forks Python commands from the server as
    :class:`ZygotePopen` does (for code the tests run in their own process that starts processes
    itself, a benchmark for example); the processes it starts are waited for inside the block."""
    saved = {name: subprocess.Popen.__dict__.get(name) for name in (*_POPEN, "_zygote_returncode", "_zygote")}
    assert _Server.socket_path is not None
    _Server.socket_path()  # the server started first, by the Popen it was started with
    _route_children()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(subprocess.Popen, name)
            else:
                setattr(subprocess.Popen, name, value)


def _route_children() -> None:
    """``subprocess.Popen`` forks Python commands from the server, as ZygotePopen (in a forked child: for good)."""
    for name in (*_POPEN, "_zygote_returncode"):
        setattr(subprocess.Popen, name, ZygotePopen.__dict__[name])
    subprocess.Popen._zygote = None  # type: ignore[attr-defined]


def _exit_code(pid: int) -> int | None:
    """The exit status of child ``pid`` as :mod:`subprocess` reports it, leaving it a zombie; None while it runs."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def serve(path: str) -> None:
    """Imports :data:`PRELOAD`, listens on ``path`` and forks a child per request until stdin closes."""
    import gc
    import importlib

    import pkgutil

    env = dict(os.environ)  # before the imports: some set variables (torch._dynamo TORCHINDUCTOR_CACHE_DIR...)
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"  # pyarrow's jemalloc (under scikit-learn)
    for name in PRELOAD:
        importlib.import_module(name)
    cadence = sys.modules["cadence"]
    for module in pkgutil.walk_packages(cadence.__path__, "cadence."):
        if not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
    from pathlib import Path

    threads = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    if len(threads) > 1:  # a child forked from a threaded process can deadlock on a lock a thread held
        raise RuntimeError(f"the zygote must stay single-threaded, but its imports started threads: {threads}")
    gc.freeze()  # what is loaded now is never collected: a child's collections leave those pages shared
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "sigchld")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    running: dict[int, socket.socket | None] = {}  # pid -> its client (None: gone), until it exits
    exited: dict[socket.socket, int] = {}  # client -> its reported, unreaped child
    # requester pid -> its children: (pid, the signal they get when it exits, whether they are in its group)
    dependents: dict[int, list[tuple[int, int | None, bool]]] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in running:
                        _kill(pid, signal.SIGKILL)
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    data, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
                    request = json.loads(data)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for sock in (listener, conn, *running.values(), *exited):
                        if sock is not None:
                            sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    use(lambda: path, env)
                    _become(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode())
                running[pid] = conn
                if request.get("requester") in running:
                    dependents.setdefault(request["requester"], []).append(
                        (pid, request.get("death_signal"), not request["new_session"]))
                selector.register(conn, selectors.EVENT_READ, "client")
            elif key.data == "sigchld":
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            else:  # a client closed its connection (or wrote, which it never does)
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                selector.unregister(conn)
                if conn in exited:
                    os.waitpid(exited.pop(conn), 0)  # reaped only now: its pid is free again
                else:  # the client is gone while its child runs: reaped when it exits
                    for pid in [p for p, c in running.items() if c is conn]:
                        running[pid] = None
                conn.close()
        for pid, conn in list(running.items()):
            code = _exit_code(pid)
            if code is None:
                continue
            del running[pid]
            for child, death_signal, in_group in dependents.pop(pid, []):
                sig = death_signal or (-code if in_group and code < 0 else None)
                if sig and child in running:
                    _kill(child, sig)
            if conn is None:
                os.waitpid(pid, 0)
                continue
            try:
                conn.sendall(json.dumps({"returncode": code}).encode())
                exited[conn] = pid
            except OSError:
                os.waitpid(pid, 0)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: the server's descriptors and handlers gone, the request's stdio, directory
    and environment in place, then the command run as ``python`` would run it. Never returns: the
    command's ``SystemExit``, an uncaught exception (its traceback printed, status 1) or a
    ``KeyboardInterrupt`` (ended by SIGINT) ends the process as it would end a fresh interpreter."""
    if request.get("new_session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reread_environment()
    _route_children()
    argv = request["argv"]
    if argv[:1] == ["-u"] or os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[attr-defined]
        argv = argv[1:] if argv[:1] == ["-u"] else argv
    try:
        _run(argv)
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except KeyboardInterrupt:
        _print_uncaught()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python does: end by SIGINT
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        _print_uncaught()
        code = 1
    else:
        code = 0
    _finish()
    os._exit(code)


def _print_uncaught() -> None:
    """The uncaught exception's traceback through ``sys.excepthook``, from the command's first frame."""
    kind, error, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    if error is not None:
        error.__traceback__ = tb
    sys.excepthook(kind, error, tb)  # type: ignore[arg-type]


def _exit_status(code: object) -> int:
    """The status ``SystemExit(code)`` ends a Python process with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What ending the interpreter does that a program can observe: non-daemon threads joined,
    ``atexit`` handlers run, unreachable objects finalized (their files closed), stdio flushed. The
    module teardown that follows in a fresh interpreter is skipped: in a forked child it would touch,
    and so copy, every page the server shares with it (seconds of CPU)."""
    import atexit
    import gc
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _run(argv: list[str]) -> None:
    """``python ARGV...``: ``-m MODULE``, ``-c CODE`` or a script path, with its arguments."""
    if argv[0] == "-m":
        if not hasattr(sys.modules.get(argv[1]), "__path__"):  # a preloaded module (not a package, whose
            sys.modules.pop(argv[1], None)  # __main__ runs) is run afresh, as a fresh interpreter would
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _reread_environment() -> None:
    """What importing reads from the environment, read again from the child's."""
    import tempfile

    tempfile.tempdir = None
    if "fsspec" in sys.modules:
        import fsspec.config

        fsspec.config.conf.clear()
        fsspec.config.set_conf_files(fsspec.config.conf_dir, fsspec.config.conf)
        fsspec.config.set_conf_env(fsspec.config.conf)


if __name__ == "__main__":
    sys.path.pop(0)  # not tests/: the children's paths are their commands'
    serve(sys.argv[1])
