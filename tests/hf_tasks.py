"""A tiny ``transformers`` GPT-2 as a cadence Task (loaded by path: ``tests/hf_tasks.py:TinyHFGPT2Task``),
built from a config (nothing is downloaded), on the Markov language of ``tests/gpt_tasks.py``.

The model returns its own loss (``model(input_ids=x, labels=x)``), so ``train_step`` is one line
around :func:`cadence.torch.hf.causal_lm_loss`; its ``lm_head.weight`` is tied to its token
embedding (GPT-2's default). :meth:`TinyHFGPT2Task.export_tokenizer` gives a word-level tokenizer
of the ``vocab`` tokens ``t0 .. t{vocab-1}`` (``tokenizers``, built in memory), so an ``hf`` export
loads with ``AutoTokenizer`` too. It imports ``transformers`` at its top, as a user's Task does (a run
without the ``hf`` extra fails on importing it, naming the extra).
"""

from __future__ import annotations

import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from cadence.torch import ResumableLoader, Task
from cadence.torch.hf import causal_lm_loss
from gpt_tasks import markov_tokens


def tiny_gpt2(vocab: int = 32, block_size: int = 16, seed: int | None = None):
    """A 2-layer GPT-2 of width 32 (``seed``: its initial weights drawn from it)."""
    if seed is not None:
        torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=block_size,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def word_tokenizer(vocab: int = 32):
    """A ``PreTrainedTokenizerFast`` over the words ``t0 .. t{vocab-1}`` (ids 0 .. vocab-1)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0", bos_token="t0")


class TinyHFGPT2Task(Task):
    """GPT-2 on token windows of ``block_size``; ``step_sleep`` slows each step (a test kills the
    run mid-way); ``tokenizer`` (default True): exports carry the word-level tokenizer."""

    def __init__(self, batch_size: int = 8, block_size: int = 16, vocab: int = 32, lr: float = 3e-3,
                 n_tokens: int = 2048, step_sleep: float = 0.0, tokenizer: bool = True) -> None:
        super().__init__()
        self.batch_size, self.block_size, self.vocab, self.lr = batch_size, block_size, vocab, lr
        self.step_sleep, self.with_tokenizer = step_sleep, tokenizer
        tokens = markov_tokens(n_tokens, vocab, seed=1)
        n = len(tokens) // block_size
        self.train_set = TensorDataset(tokens[: n * block_size].view(n, block_size))
        val = markov_tokens(n_tokens // 4, vocab, seed=2)
        self.val_set = TensorDataset(val[: len(val) // block_size * block_size].view(-1, block_size))

    def build_model(self):
        return tiny_gpt2(self.vocab, self.block_size)

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.lr)

    def build_inputs(self, split, ctx):
        if split == "train":
            return ResumableLoader(self.train_set, ctx.per_rank_batch(self.batch_size), seed=ctx.seed,
                                   rank=ctx.rank, world_size=ctx.world_size, drop_last=True)
        return DataLoader(ctx.wrap_dataset(self.val_set), batch_size=16)

    def train_step(self, model, batch):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        (ids,) = batch
        return causal_lm_loss(model(input_ids=ids, labels=ids))

    def validation_step(self, model, batch):
        (ids,) = batch
        return {"loss": causal_lm_loss(model(input_ids=ids), labels=ids)}

    def example_inputs(self):
        return (self.val_set.tensors[0][:2],)

    def export_tokenizer(self):
        return word_tokenizer(self.vocab) if self.with_tokenizer else None
