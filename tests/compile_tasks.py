"""Tasks of tests/processes/test_torch_compile.py (loaded by path: ``tests/compile_tasks.py:PlainTask``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask  # noqa: E402


class PlainTask(TinyTask):
    """TinyTask without dropout: inductor draws its random numbers otherwise than eager kernels,
    so only a model without randomness can be compared across the two."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 2))


class Block(nn.Module):
    """A linear layer whose forward breaks the graph (``fullgraph: true`` cannot compile it)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()
        return x


class BlockModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(8, 16), nn.ReLU(), Block(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class GraphBreakTask(TinyTask):
    """Its blocks (the FSDP units) break the graph."""

    fsdp_unit_classes = (Block,)

    def build_model(self) -> nn.Module:
        return BlockModel()


class PrecompiledTask(TinyTask):
    """``build_model`` returns ``torch.compile(model)``: an ``OptimizedModule``, whose own
    ``state_dict`` keys start with ``_orig_mod.``."""

    def build_model(self) -> nn.Module:
        return torch.compile(super().build_model(), backend="aot_eager")  # type: ignore[return-value]
