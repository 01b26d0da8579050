"""The llama_tp example: a tiny Llama (``transformers``' ``LlamaForCausalLM`` built from a
``LlamaConfig``: attention with grouped key/value heads, a SwiGLU MLP, RMSNorm, rotary positions,
tied embeddings) trained as a character-level language model of generated arithmetic
("37+45=82;"), on a device mesh: tensor parallelism inside each pair of ranks, FSDP across them.

    cadence train examples/llama_tp/config.yaml --nproc 4                      # dp_shard 2 x tp 2
    cadence train examples/llama_tp/config.yaml --set trainer.parallel.tp=1   # one process

:meth:`LlamaTask.parallelize` applies torchtitan's Llama plan to every decoder layer with
``parallelize_module`` over ``mesh["tp"]``: the query, key, value, gate and up projections split by
columns (each rank computes its own heads and its part of the MLP's hidden width), the output and
down projections by rows (their outputs all-reduced). The embedding, the tied ``lm_head`` and the
norms stay replicated over the TP ranks. cadence then shards the decoder layers
(:meth:`LlamaTask.fsdp_units`) and the root with FSDP2 over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.metrics import Mean
from cadence.torch import Context, ResumableLoader, Task

VOCAB = "0123456789+=;"
CHAR_ID = {c: i for i, c in enumerate(VOCAB)}


def make_corpus(n: int, seq_len: int, seed: int) -> TensorDataset:
    """``n`` rows of ``seq_len`` character ids cut from a stream of sums ``a+b=c;`` (``a``, ``b`` in
    0..99); deterministic in ``seed``. A row is its own label (the model shifts it)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        text = ""
        while len(text) < seq_len:
            a, b = (int(v) for v in rng.integers(0, 100, size=2))
            text += f"{a}+{b}={a + b};"
        rows.append([CHAR_ID[c] for c in text[:seq_len]])
    return TensorDataset(torch.tensor(rows, dtype=torch.long))


class LlamaTask(Task):
    """A ``LlamaForCausalLM`` of ``layers`` decoder layers of width ``hidden`` (``heads`` query heads,
    ``kv_heads`` key/value heads, MLP width ``intermediate``) over :func:`make_corpus` rows of
    ``seq_len`` characters, ``global_batch_size`` rows a step split over the data-parallel ranks.

    ``trainer.parallel.tp`` must divide ``kv_heads`` (:attr:`tp_divisor`): each TP rank holds whole
    key/value heads and the query heads that share them."""

    def __init__(self, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                 seq_len: int = 32, global_batch_size: int = 16, lr: float = 3e-3, weight_decay: float = 0.01,
                 train_samples: int = 2048, validation_samples: int = 128) -> None:
        super().__init__()
        self.hidden, self.layers, self.heads, self.kv_heads = hidden, layers, heads, kv_heads
        self.intermediate, self.seq_len, self.global_batch_size = intermediate, seq_len, global_batch_size
        self.lr, self.weight_decay = lr, weight_decay
        self.tp_divisor = kv_heads
        self.train_set = make_corpus(train_samples, seq_len, seed=0)
        self.val_set = make_corpus(validation_samples, seq_len, seed=1)

    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=self.hidden, intermediate_size=self.intermediate,
                             num_hidden_layers=self.layers, num_attention_heads=self.heads,
                             num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq_len,
                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=CHAR_ID[";"],
                             pad_token_id=None)
        return LlamaForCausalLM(config)  # its loss: next-token cross-entropy (labels=input_ids, shifted inside)

    def parallelize(self, model: nn.Module, tp_mesh: Any) -> nn.Module:
        """torchtitan's plan for each decoder layer: q/k/v and gate/up by columns, o and down by rows.
        ``LlamaAttention`` reshapes its projections with ``-1`` heads, so a rank's forward runs its
        ``heads / tp`` query and ``kv_heads / tp`` key/value heads as they are."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, plan)
        return model

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def build_inputs(self, split: str, ctx: Context):
        if split == "train":
            # the ranks of one TP group read the same rows: the data splits over the data-parallel ranks
            batch = ctx.per_rank_batch(self.global_batch_size, name="task.params.global_batch_size")
            return ResumableLoader(self.train_set, batch, shuffle=True, seed=ctx.seed, rank=ctx.dp_rank,
                                   world_size=ctx.dp_size, drop_last=True)
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=32)

    def train_step(self, model: nn.Module, batch) -> torch.Tensor:
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss  # the model's own next-token loss

    def tokens_per_batch(self, batch) -> int:
        return batch[0].numel()

    def build_metrics(self):
        return {"accuracy": Mean()}

    def validation_step(self, model: nn.Module, batch) -> dict[str, Any]:
        (ids,) = batch
        output = model(input_ids=ids, labels=ids)
        correct = output.logits[:, :-1].argmax(dim=-1) == ids[:, 1:]
        return {"loss": output.loss, "accuracy": (correct.sum(), correct.numel())}  # next-character accuracy
