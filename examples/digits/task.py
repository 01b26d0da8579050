"""The digits example: scikit-learn's bundled 8x8 handwritten digits (no download), a small MLP.

    cadence train examples/digits/config.yaml --model-dir runs/digits
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence.torch import Context, ResumableLoader, Task


def load_digits_split(seed: int = 0, validation_fraction: float = 0.2):
    """Standardised features and labels, split once with a fixed permutation."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32) * 2.0
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(len(x) * validation_fraction)
    val, train = order[:n_val], order[n_val:]
    as_ds = lambda idx: TensorDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]).long())
    return as_ds(train), as_ds(val)


class DigitsTask(Task):
    def __init__(self, hidden: int = 128, dropout: float = 0.1, lr: float = 3e-3,
                 weight_decay: float = 1e-4, global_batch_size: int = 64) -> None:
        super().__init__()
        self.hidden, self.dropout, self.lr = hidden, dropout, lr
        self.weight_decay, self.global_batch_size = weight_decay, global_batch_size
        self.train_set, self.val_set = load_digits_split()

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, self.hidden), nn.ReLU(), nn.Dropout(self.dropout), nn.Linear(self.hidden, 10)
        )

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def build_inputs(self, split: str, ctx: Context):
        if split == "train":
            # Endless, shuffled, resumable mid-epoch, sharded over ranks: the data position is
            # checkpointed in global samples, so a run can resume on another number of processes.
            # The config gives the global batch: each of N ranks loads 1/N of it, so every step
            # trains on the same samples with --nproc N as with one process (drop_last on any
            # number of ranks: the same epochs, without a smaller last batch).
            batch = ctx.per_rank_batch(self.global_batch_size, name="task.params.global_batch_size")
            return ResumableLoader(self.train_set, batch, shuffle=True, seed=ctx.seed,
                                   rank=ctx.dp_rank, world_size=ctx.dp_size, drop_last=True)
        # Each rank evaluates its own unpadded shard; the metrics are reduced exactly across ranks.
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=256)

    def example_inputs(self) -> tuple[torch.Tensor]:
        """A batch of inputs, for exports that trace the model (torch.export, TorchScript, ONNX)."""
        return (self.val_set.tensors[0][:8],)

    def train_step(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model: nn.Module, batch) -> dict:
        x, y = batch
        logits = model(x)
        return {
            "loss": F.cross_entropy(logits, y),
            "accuracy": (logits.argmax(dim=1) == y).float().mean(),
        }
