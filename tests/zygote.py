"""A fork server for the process tier: one interpreter per pytest worker that has imported torch and
cadence once, and forks a child per command.

Starting ``python -m cadence`` costs about 4 s of CPU on these machines, nearly all of it importing
torch, and the process tier starts hundreds of them. A child forked from this server is a real process
(its own pid, its own stdio, real signals, ``kill -9``, its own exit status) that runs the command
exactly as ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` would, from an interpreter whose
``sys.modules`` already holds what the command would import. The server does nothing else before it
forks: it imports, then waits.

What a fresh interpreter reads from its environment while importing is read again in the child
(fsspec's ``FSSPEC_*`` configuration, ``tempfile``'s directory). Keys that torch, OpenMP or Python
itself read at start-up (:data:`STARTUP_ENV_PREFIXES`) cannot be read again: a command whose
environment differs from the server's in one of them is started as a plain process by the client
(:func:`cli_run.run_cadence`), as is every command when ``CADENCE_TEST_FORK=0``.

Protocol (``AF_UNIX``, ``SOCK_SEQPACKET``, one connection per child): the client sends one JSON
message ``{"argv": [...], "env": {...}, "cwd": ..., "new_session": bool}`` with three file
descriptors (stdin, stdout, stderr); the server answers ``{"pid": N}``, and once the child has
exited, ``{"returncode": R}`` (``-SIG`` when a signal ended it, as :mod:`subprocess` reports it).
The child stays a zombie until the client closes the connection, so its pid is never reused while a
client may still signal it. The server exits when its stdin closes (its pytest worker is gone).
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

STARTUP_ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "CUBLAS",
                        "NCCL", "LD_", "MALLOC")
"""Environment keys read while torch or Python start: a command that changes one runs unforked."""

PRELOAD = ("torch", "numpy", "cadence.cli.main", "cadence.torch.experiments", "cadence.torch.loop.trainer",
           "cadence.torch.checkpoint_io.sharded")
"""What the server imports before it forks (what nearly every ``cadence`` command imports)."""

MESSAGE = 1 << 20


def _exit_code(pid: int) -> int | None:
    """The exit status of child ``pid`` as :mod:`subprocess` reports it, leaving it a zombie; None while it runs."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def serve(path: str) -> None:
    """Imports :data:`PRELOAD`, listens on ``path`` and forks a child per request until stdin closes."""
    import importlib

    import gc

    for name in PRELOAD:
        importlib.import_module(name)
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
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in running:
                        _kill(pid)
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
                    _become(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode())
                running[pid] = conn
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
            if conn is None:
                os.waitpid(pid, 0)
                continue
            try:
                conn.sendall(json.dumps({"returncode": code}).encode())
                exited[conn] = pid
            except OSError:
                os.waitpid(pid, 0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
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
    argv = request["argv"]
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
