"""The charlm example: a small causal transformer that learns a character-level language model of
generated arithmetic ("37+45=82;"), no download.

    cadence train examples/charlm/config.yaml --model-dir runs/charlm
    cadence train examples/charlm/config.yaml --model-dir runs/charlm --nproc 2 --set trainer.strategy=fsdp

Its transformer layers (``nn.TransformerEncoderLayer``) are the FSDP units under
``trainer.strategy: fsdp`` (``Task.fsdp_unit_classes``): each is sharded on its own, the
embeddings and the head with the root.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence.metrics import Mean
from cadence.torch import Context, ExportSpec, ResumableLoader, Task

VOCAB = "0123456789+=;"
CHAR_ID = {c: i for i, c in enumerate(VOCAB)}


def make_corpus(n: int, seq_len: int, seed: int, max_operand: int = 99) -> TensorDataset:
    """``n`` samples ``(x, y, answer)``: ``x`` the ids of ``seq_len`` characters of a stream of
    sums ``a+b=c;``, ``y`` the next characters, ``answer`` 1 where ``y`` is part of a result
    (the digits after ``=`` and the closing ``;``), the characters that the preceding ones
    determine. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    xs, ys, answers = [], [], []
    for _ in range(n):
        text, in_answer = "", []
        while len(text) < seq_len + 1:
            a, b = (int(v) for v in rng.integers(0, max_operand + 1, size=2))
            question, result = f"{a}+{b}=", f"{a + b};"
            text += question + result
            in_answer += [0] * len(question) + [1] * len(result)
        ids = [CHAR_ID[c] for c in text[: seq_len + 1]]
        xs.append(ids[:-1])
        ys.append(ids[1:])
        answers.append(in_answer[1 : seq_len + 1])
    as_tensor = lambda rows, dtype: torch.tensor(rows, dtype=dtype)
    return TensorDataset(as_tensor(xs, torch.long), as_tensor(ys, torch.long), as_tensor(answers, torch.float32))


class CharTransformer(nn.Module):
    """Token and position embeddings, causal ``nn.TransformerEncoderLayer``s, a linear head.

    Any sequence length up to ``seq_len`` (the positions it has embeddings for)."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, layers: int, ff: int,
                 dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(t, device=x.device))
        # -inf above the diagonal, made for this length (not sliced from a buffer of the longest:
        # torch.export would then fix the length, and the export could not run shorter sequences)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        # (batch, time, vocab) logits. Not self.head(h): nn.Linear on a 3-d input returns a view,
        # which FSDP2 warns about at the root's output; matmul then + bias is the same, not a view.
        return torch.matmul(self.norm(h), self.head.weight.t()) + self.head.bias


class CharLMTask(Task):
    def __init__(self, seq_len: int = 32, d_model: int = 48, heads: int = 4, layers: int = 2, ff: int = 96,
                 dropout: float = 0.0, lr: float = 3e-3, weight_decay: float = 1e-4, batch_size: int = 32,
                 train_samples: int = 4096, validation_samples: int = 512, max_operand: int = 99) -> None:
        super().__init__()
        self.seq_len, self.d_model, self.heads, self.layers, self.ff = seq_len, d_model, heads, layers, ff
        self.dropout, self.lr, self.weight_decay, self.batch_size = dropout, lr, weight_decay, batch_size
        self.train_set = make_corpus(train_samples, seq_len, seed=0, max_operand=max_operand)
        self.val_set = make_corpus(validation_samples, seq_len, seed=1, max_operand=max_operand)

    def build_model(self) -> nn.Module:
        return CharTransformer(len(VOCAB), self.seq_len, self.d_model, self.heads, self.layers, self.ff, self.dropout)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def build_inputs(self, split: str, ctx: Context):
        if split == "train":
            # Endless, shuffled, resumable mid-epoch (its position is checkpointed), sharded over ranks.
            return ResumableLoader(self.train_set, self.batch_size, shuffle=True, seed=ctx.seed,
                                   rank=ctx.dp_rank, world_size=ctx.dp_size, drop_last=ctx.world_size > 1)
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=128)

    def example_inputs(self) -> tuple[torch.Tensor]:
        """A batch of token ids, for the exports that trace the model (torch.export, ONNX)."""
        return (self.val_set.tensors[0][:2],)

    def export_spec(self) -> ExportSpec:
        # Batch and sequence length dynamic: the exports run any batch of up to seq_len characters.
        return ExportSpec(dynamic_dims=[{0: "batch", 1: ("seq", 1, self.seq_len)}],
                          input_names=["tokens"], output_names=["logits"])

    def train_step(self, model: nn.Module, batch) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def tokens_per_batch(self, batch) -> int:
        # tokens_per_second in the train summaries: every input character is a token (from the shape).
        return batch[0].numel()

    def build_metrics(self):
        # Means over characters, exact over any number of ranks: fed (sum, count) per batch.
        return {"accuracy": Mean(), "answer_accuracy": Mean()}

    def validation_step(self, model: nn.Module, batch) -> dict:
        x, y, answer = batch
        logits = model(x)
        correct = (logits.argmax(dim=-1) == y).float()
        return {
            "loss": F.cross_entropy(logits.flatten(0, 1), y.flatten()),  # a batch mean, weighted by batch size
            "accuracy": (correct.sum(), correct.numel()),  # next-character accuracy; chance: 1/13
            "answer_accuracy": ((correct * answer).sum(), answer.sum()),  # on the sums' results only
        }
