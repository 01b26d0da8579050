"""Tasks of the gpu tier (loaded by path: ``tests/gpu/cuda_tasks.py:DeterministicTinyTask``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks import TinyTask  # noqa: E402

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""What a process running :class:`DeterministicTinyTask` on CUDA needs in its environment: cuBLAS
gives bit-reproducible results only with a fixed workspace (torch raises without it)."""


class DeterministicTinyTask(TinyTask):
    """TinyTask (an MLP with dropout on a shuffled resumable loader) with torch's deterministic
    algorithms on (the process needs :data:`DETERMINISTIC_ENV`): deterministic kernels where torch
    has a choice, and a warning naming an op that has none (``warn_only``: the tests compare the
    bits of the weights, which says whether it mattered).

    ``probe_dir``: ``build_model`` writes ``rank<N>.backend`` there, the default process group's
    backend (``none`` without one): which backend a job's collectives ran on."""

    def __init__(self, probe_dir: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.probe_dir = probe_dir
        torch.use_deterministic_algorithms(True, warn_only=True)

    def build_model(self) -> nn.Module:
        if self.probe_dir is not None:
            dist = torch.distributed
            backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
            Path(self.probe_dir, f"rank{os.environ.get('RANK', '0')}.backend").write_text(str(backend))
        return super().build_model()
