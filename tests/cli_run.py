"""Starting processes as a user does, for the process tier: ``python -m cadence`` (:func:`run_cadence`)
and torchrun jobs (:func:`run_torchrun`), one torch thread per process, this checkout's sources first
on the path. ``ROOT`` is the checkout, ``TESTS`` the folder of the tests' helper modules (tasks,
workers) that the processes load by path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
"""The environment of the processes: the caller's, one torch thread, this checkout's ``src``, a
console 200 columns wide (so that no log line a test looks for is wrapped)."""


def run_cadence(*args: str, env: dict[str, str] | None = None, timeout: float = 300, check: bool = False,
                **kwargs: Any) -> subprocess.CompletedProcess:
    """``cadence ARGS...`` to completion, output captured as text; ``env`` adds to :data:`ENV`,
    ``check`` asserts exit status 0 (the message is the output), other keywords go to ``subprocess.run``."""
    proc = subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout, **kwargs)
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
    return subprocess.run(torchrun_command(nproc, *args, tee=tee), capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout, **kwargs)


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
