"""Several torchrun nodes on one machine, for the process tier: ``cadence train ... --nnodes N --node-rank I
--rdzv-endpoint 127.0.0.1:PORT`` started as node I (:func:`start_node`), each in a session of its own so that
a test can end a whole node at once, as a machine dies (:func:`kill_node`).

The node started first hosts the rendezvous store on ``port`` (torch's agents on one host race for it; the
loser connects as a client): start node 0 first and wait for :func:`listening` before the others, so that
node 0 holds the store, as ``--rdzv-endpoint`` on node 0's host does on a cluster.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Sequence

from cli_run import ENV, popen


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` (the rendezvous store is up)."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


NODE_ENV = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
"""The nodes' environment: :data:`cli_run.ENV` without ``OMP_NUM_THREADS``, as a user's shell has it, so that
each layout runs with the intra-op threads cadence gives it (which must not change the weights). Its
processes start as fresh interpreters: the zygote's children keep the zygote's threads."""


FAST_RDZV = ("--rdzv-conf", "keep_alive_interval=2,keep_alive_max_attempt=3")
"""Rendezvous settings for a test that loses a node (``extra=FAST_RDZV``): the lost node's agent is dropped
from the rendezvous after about 6 s instead of torch's 15 (5 s x 3), so that the node coming back is admitted
sooner."""


def node_command(config: str | os.PathLike[str], model_dir: str | os.PathLike[str], node_rank: int, nnodes: int,
                 port: int, *, nproc: int = 1, max_restarts: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The arguments after ``python`` that run node ``node_rank`` of an ``nnodes``-node job."""
    return ["-m", "cadence", "train", os.fspath(config), "--model-dir", os.fspath(model_dir), "--nproc", str(nproc),
            "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--no-progress", *(["--max-restarts", str(max_restarts)] if max_restarts is not None else []), *extra]


def start_node(config: str | os.PathLike[str], model_dir: str | os.PathLike[str], node_rank: int, nnodes: int,
               port: int, *, nproc: int = 1, max_restarts: int | None = None, extra: Sequence[str] = (),
               env: dict[str, str] | None = None, stdout: IO[Any] | int | None = None,
               stderr: IO[Any] | int | None = subprocess.STDOUT) -> subprocess.Popen:
    """Node ``node_rank`` as a running process (``cadence train`` and, in its process group, torch's agent;
    the workers each in a session of their own); ``env`` adds to :data:`NODE_ENV`; stdout and stderr
    go where given (default: stderr into stdout)."""
    return popen(node_command(config, model_dir, node_rank, nnodes, port, nproc=nproc, max_restarts=max_restarts,
                              extra=extra),
                 env={**NODE_ENV, **(env or {})}, stdout=stdout, stderr=stderr, start_new_session=True)


def wait_until(what: str, ready: Any, timeout: float = 60.0, procs: Sequence[subprocess.Popen] = (),
               logs: Sequence[Path] = ()) -> Any:
    """Poll ``ready()`` every 20 ms until it returns something true (returned); fails when one of ``procs``
    ends first or after ``timeout`` seconds, with the tails of ``logs``."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        ended = [p for p in procs if p.poll() is not None]
        tails = "\n".join(f"--- {log}:\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        assert not ended, f"a node ended (status {ended[0].returncode}) before {what}:\n{tails}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{tails}"
        time.sleep(0.02)


def kill_node(node: subprocess.Popen, workers: Sequence[int] = (), timeout: float = 30.0) -> None:
    """SIGKILL to each of ``workers`` and to ``node``'s whole process group at once, as a machine dies;
    returns once ``node`` has exited."""
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.wait(timeout=timeout)


def stop_nodes(nodes: Sequence[subprocess.Popen], workers: Sequence[int] = ()) -> None:
    """End what is left of a test's nodes (after a failure half-way): their process groups and ``workers``."""
    for node in nodes:
        if node.poll() is None:
            kill_node(node)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
