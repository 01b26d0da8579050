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
