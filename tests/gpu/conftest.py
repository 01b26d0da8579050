"""The gpu tier (``make test-gpu``): the CUDA paths of cadence. ``tests/conftest.py`` marks every
test here ``gpu`` and skips it without CUDA, with one reason; they are still collected, so an
import error shows on any machine. The shared helpers of ``tests/`` (``cli_run``, ``tasks``) and
of this folder are importable from here."""

from __future__ import annotations

import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for folder in (TESTS, HERE):  # whatever pytest's import mode
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
