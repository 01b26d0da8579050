"""The suite's tiers and shared fixtures.

Tiers, by folder (the one place where markers are applied, :func:`pytest_collection_modifyitems`):

- ``tests/unit/``: marker ``unit``; no process is started, so ``make test-fast`` (``-m unit``) is quick;
- ``tests/processes/``: marker ``processes``; the tests start processes (``cadence`` runs, torchrun
  jobs, servers, interpreters);
- ``tests/gpu/``: marker ``gpu``; the CUDA paths, skipped with a one-line reason where CUDA is absent.

The helper modules the tests import (``tasks``, ``fakes``, ``cli_run``, the torchrun workers, ...) live in
``tests/`` itself, which pytest puts on ``sys.path`` because this file is there.

Fixtures: ``cadence`` (the CLI runner, :func:`cli_run.run_cadence`), ``torchrun`` (:func:`cli_run.run_torchrun`),
``write_config`` (:func:`configs.write_config`), ``memdir`` (a fresh ``memory://`` directory),
``s3_server`` (moto on a held port), ``slurm_cluster`` (a one-machine Slurm, tests/slurm_cluster.py),
``closed_port`` (a port that refuses connections and stays so), ``digits_run`` (the digits example
trained once for the whole run, for the tests that only read it).
Every test also runs with the process-global state that ``cadence.cli.main`` and ``load_task_class``
change (logging, ``sys.path``, signal handlers, torch's threads) restored afterwards, so that tests do not depend on
their order or on the xdist worker they land on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

TIERS = {"unit": "unit", "processes": "processes", "gpu": "gpu"}
"""Folder under tests/ -> the marker its tests get."""

_HERE = Path(__file__).resolve().parent
GPU_SKIP_REASON = "gpu tier: CUDA is not available on this machine"
"""The one reason every gpu-tier test is skipped with where ``torch.cuda.is_available()`` is False."""


def pytest_configure(config: pytest.Config) -> None:
    """A test file directly in tests/ is refused before anything runs, also by pytest-xdist's
    controller (which collects nothing itself: a worker's collection error would only crash it)."""
    stray = sorted(p.name for p in _HERE.glob("test_*.py"))
    if stray:
        raise pytest.UsageError(f"tests/{stray[0]}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/"
                                + (f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""))


HEAVY_FIRST = ("test_fsdp", "test_sharded_checkpoint", "test_torch_compile", "test_disk_full", "test_s3",
               "test_distributed_training", "test_sweep", "test_elastic", "test_benchmarks_smoke",
               "test_stateful_dataloader", "test_trackers", "test_cli", "test_torch_distributed",
               "test_charlm_example", "test_external_evaluators", "test_sidecar_processes", "test_writer_lease")
"""The process tier's modules that take longest (seconds of CPU, measured), longest first: a
scheduling hint of small effect, which costs wall time when stale, never a result. pytest-xdist's
``--dist loadscope`` hands out modules sorted by their number of tests, most first (its
``--loadscope-reorder`` default), so this order decides only among modules with as many tests.
Handing them out in this order instead (``--no-loadscope-reorder``) measured slower, 10:52 against
10:30 with 2 workers: the long modules then all run at once, side by side."""


def _schedule_order(item: pytest.Item) -> tuple[int, int]:
    """The process tier's heavy modules (:data:`HEAVY_FIRST`, in order), then its others, then the unit
    and gpu tiers; a stable sort keeps each module's tests in their own order."""
    path = Path(item.path)
    if path.parent.name != "processes":
        return (2, 0)
    return (0, HEAVY_FIRST.index(path.stem)) if path.stem in HEAVY_FIRST else (1, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its folder's tier; a test outside the tier folders is an error (so a
    new file cannot escape ``make test-fast``'s selection unnoticed). Without CUDA the ``gpu``
    tier is skipped with one reason. The tests are then ordered for pytest-xdist, longest modules
    first (:func:`_schedule_order`)."""
    cuda = None
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue  # a test from outside tests/ (an explicit path): no tier
        tier = TIERS.get(folder)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)
        if tier == "gpu":
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))
    items.sort(key=_schedule_order)


# -- process-global state -------------------------------------------------------------------------

_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", None),
                        getattr(signal, "SIGUSR2", None), getattr(signal, "SIGHUP", None)) if s is not None]


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Puts back what in-process ``cadence.cli.main`` / ``run_training`` / ``load_task_class`` calls
    change for the whole process: the root logger's handlers and level, the levels of named loggers,
    ``sys.path``, the signal handlers (the main thread's) and torch's intra-op threads."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {name: lg.level for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    path = list(sys.path)
    handlers_by_signal = {s: signal.getsignal(s) for s in _SIGNALS}
    torch = sys.modules.get("torch")  # not imported here: a unit test of the core never imports it
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and lg.level != named.get(name, logging.NOTSET):
            lg.setLevel(named.get(name, logging.NOTSET))
    sys.path[:] = path
    for s, handler in handlers_by_signal.items():
        if signal.getsignal(s) is not handler and handler is not None:
            try:
                signal.signal(s, handler)
            except ValueError:  # not the main thread
                pass


# -- shared fixtures --------------------------------------------------------------------------------


@pytest.fixture
def cadence() -> Callable[..., Any]:
    """The CLI runner: ``cadence("train", config, "--model-dir", run, check=True, env=..., cwd=...)``,
    :func:`cli_run.run_cadence`."""
    from cli_run import run_cadence

    return run_cadence


@pytest.fixture
def torchrun() -> Callable[..., Any]:
    """A one-node torchrun job to completion: ``torchrun(2, worker, *args)``, :func:`cli_run.run_torchrun`."""
    from cli_run import run_torchrun

    return run_torchrun


@pytest.fixture
def write_config() -> Callable[..., Path]:
    """The tiny-config builder, :func:`configs.write_config`."""
    from configs import write_config

    return write_config


@pytest.fixture
def memdir() -> Iterator[str]:
    """A fresh ``memory://`` checkpoints directory (not created yet); its root is removed afterwards."""
    import fsspec

    root = f"memory://cadence-test-{uuid.uuid4().hex}"
    yield f"{root}/checkpoints"
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A running :class:`s3_server.S3Server` for the session (one per xdist worker, each on its own held
    port); this process's environment points at it meanwhile, so in-process s3fs use and the cadence
    subprocesses, which inherit it, reach the same server."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3_server import S3Server

    with S3Server() as server:
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running one-machine Slurm (:class:`slurm_cluster.SlurmCluster`) for the session; skipped, with
    one reason, where it cannot start (no Slurm or munge binaries, not root). One per machine: its
    tests live in one module (tests/processes/test_slurm_jobs.py), which ``--dist loadscope`` gives to one
    worker."""
    from slurm_cluster import SlurmCluster, missing

    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port of 127.0.0.1 where a connection is refused, for the whole test: it is kept bound (never
    listening) by this fixture, so no other test or process can start serving on it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> tuple[Path, subprocess.CompletedProcess]:
    """``cadence train examples/digits/config.yaml`` to completion (600 steps; run from the model dir's
    parent, so the config's relative task path must resolve against the config file), once for the
    whole run, xdist workers included (the first trains under a file lock, the others wait and
    share it): its model dir and its process (output captured). The tests only read the model dir,
    or run a command that must leave it as it is."""
    from filelock import FileLock

    from cli_run import ROOT, run_cadence

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # the run's folder, above each worker's own
    where = shared / "digits-shared"
    model_dir, record = where / "run", where / "process.json"
    with FileLock(str(shared / "digits-shared.lock")):
        if not record.exists():
            where.mkdir(exist_ok=True)
            proc = run_cadence("train", str(ROOT / "examples" / "digits" / "config.yaml"), "--model-dir",
                               str(model_dir), cwd=where)
            record.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                          "stdout": proc.stdout, "stderr": proc.stderr}))
    done = json.loads(record.read_text())
    assert done["returncode"] == 0, done["stdout"] + done["stderr"]
    return model_dir, subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"], done["stderr"])
