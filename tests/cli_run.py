"""Running ``python -m cadence`` as a user does, for the end-to-end tests: one process per call,
one torch thread, this checkout's sources first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
"""The environment of the processes: the caller's, one torch thread, this checkout's ``src``."""


def run_cadence(*args: str, env: dict[str, str] | None = None, timeout: float = 180,
                **kwargs: Any) -> subprocess.CompletedProcess:
    """``cadence ARGS...`` to completion, output captured as text; ``env`` adds to :data:`ENV`,
    other keywords go to ``subprocess.run``."""
    return subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True,
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
