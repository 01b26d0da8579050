"""Tasks of tests/processes/test_activation_checkpointing.py and test_dp_loss.py (loaded by path:
``tests/ac_tasks.py:BlockTask``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask  # noqa: E402


class DropoutBlock(nn.Module):
    """A residual block with dropout inside: its recomputation must draw the same mask."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.relu(self.linear(x)))


class BlockModel(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(DropoutBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlockTask(TinyTask):
    """TinyTask's data on four dropout blocks, its FSDP units (and so its checkpointed units)."""

    fsdp_unit_classes = (DropoutBlock,)

    def build_model(self) -> nn.Module:
        return BlockModel()


class NoUnitsTask(BlockTask):
    """Names no units: activation checkpointing has nothing to apply to."""

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return []


class LossRecordingTask(TinyTask):
    """TinyTask whose every training loss is appended to ``loss_dir/rank<R>.txt`` (one line a step)."""

    def __init__(self, loss_dir: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.loss_file = Path(loss_dir, f"rank{os.environ.get('RANK', '0')}.txt")

    def train_step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        with self.loss_file.open("a") as f:
            f.write(f"{loss.item()!r}\n")
        return loss
