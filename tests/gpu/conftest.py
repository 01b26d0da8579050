"""The gpu tier (``make test-gpu``): the CUDA paths of cadence, each test marked ``gpu``.

Without CUDA every test here is skipped, all with one reason (:data:`SKIP_REASON`, one line in
the summary); they are still collected, so an import error shows on any machine. The shared
helpers of ``tests/`` (``cli_run``, ``tasks``) and of this folder are importable from here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for folder in (TESTS, HERE):  # whatever pytest's import mode
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

SKIP_REASON = "gpu tier: CUDA is not available on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``gpu`` (the hook sees the whole session's items: only those
    under this folder are marked)."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    """Skip without CUDA (raised here, so the summary folds every test into one line)."""
    if not torch.cuda.is_available():
        pytest.skip(SKIP_REASON)
