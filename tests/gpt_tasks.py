"""A small weight-tied GPT, shaped as the popular public training scripts write one (loaded by path:
``tests/gpt_tasks.py:TinyGPTTask``).

Its ``lm_head.weight`` *is* ``transformer.wte.weight`` (one Parameter under two names), and its
``forward(idx, targets=None)`` returns ``(logits, loss)`` with ``loss`` ``None`` when no targets are
given, as nanoGPT's does. The data is a fixed random "language" of ``vocab`` tokens: a first-order
Markov chain, so a model can learn it and a validation loss falls.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence.torch import ResumableLoader, Task


class Block(nn.Module):
    """Pre-norm attention + MLP, causal."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm, and a head tied to the
    token embedding."""

    def __init__(self, vocab: int = 32, block_size: int = 16, n_embd: int = 32, n_layer: int = 2,
                 n_head: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, n_embd),
            "wpe": nn.Embedding(block_size, n_embd),
            "drop": nn.Dropout(dropout),
            "h": nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
            "ln_f": nn.LayerNorm(n_embd),
        })
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * n_layer) if "mlp.2" in name else 1.0))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        for block in self.transformer["h"]:
            x = block(x)
        logits = self.lm_head(self.transformer["ln_f"](x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def markov_tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` tokens of a fixed first-order Markov chain (its transitions drawn with seed 0)."""
    transitions = torch.softmax(3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)), dim=1)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    for i in range(1, n):
        out[i] = torch.multinomial(transitions[out[i - 1]], 1, generator=g)
    return out


def windows(tokens: torch.Tensor, block_size: int) -> TensorDataset:
    """Non-overlapping (input, next-token target) windows of ``block_size``."""
    n = (len(tokens) - 1) // block_size
    x = tokens[: n * block_size].view(n, block_size)
    y = tokens[1 : n * block_size + 1].view(n, block_size)
    return TensorDataset(x, y)


class TinyGPTTask(Task):
    """The tiny GPT on the Markov language.

    ``named_splits`` (default True): validation is ``{"train": a sample of the training data,
    "val": held-out data}``; False: the held-out data alone.
    ``fsdp_unit_classes``: the blocks (the root keeps the tied embedding and head together).
    ``step_sleep`` slows each training step down (a test kills the run mid-way).
    """

    fsdp_unit_classes = (Block,)

    def __init__(self, batch_size: int = 8, block_size: int = 16, vocab: int = 32, lr: float = 3e-3,
                 named_splits: bool = True, n_tokens: int = 4096, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep
        self.batch_size, self.block_size, self.vocab, self.lr = batch_size, block_size, vocab, lr
        self.named_splits = named_splits
        self.train_set = windows(markov_tokens(n_tokens, vocab, seed=1), block_size)
        self.val_set = windows(markov_tokens(n_tokens // 4, vocab, seed=2), block_size)
        self.train_sample = TensorDataset(*(t[: len(self.val_set)] for t in self.train_set.tensors))

    def build_model(self) -> nn.Module:
        return TinyGPT(vocab=self.vocab, block_size=self.block_size)

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.1)

    def build_inputs(self, split, ctx):
        if split == "train":
            return ResumableLoader(self.train_set, ctx.per_rank_batch(self.batch_size), seed=ctx.seed,
                                   rank=ctx.rank, world_size=ctx.world_size, drop_last=True)
        val = DataLoader(ctx.wrap_dataset(self.val_set), batch_size=32)
        if not self.named_splits:
            return val
        return {"train": DataLoader(ctx.wrap_dataset(self.train_sample), batch_size=32), "val": val}

    def example_inputs(self):
        return (self.val_set.tensors[0][:2],)

    def tokens_per_batch(self, batch):
        return batch[0].numel()

    def train_step(self, model, batch):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        x, y = batch
        _, loss = model(x, y)
        return loss

    def validation_step(self, model, batch):
        x, y = batch
        logits, _ = model(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), y.flatten())}
