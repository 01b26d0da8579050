"""The hf_gpt2 example: a tiny GPT-2 (``transformers``' ``GPT2LMHeadModel`` built from a
``GPT2Config``) trained on text tokenized with a byte-level BPE and packed into blocks, read from
``datasets`` Arrow files through torchdata's ``StatefulDataLoader`` with worker processes.

    python examples/hf_gpt2/prepare.py --out runs/hf_gpt2_data
    cadence train examples/hf_gpt2/config.yaml --model-dir runs/hf_gpt2

The loader's position (its sampler's and workers' state) is checkpointed, every rank its own, so a
run killed mid-epoch resumes bit-identically. The loss is the model's own (``labels=input_ids``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence.errors import ConfigError
from cadence.metrics import Mean
from cadence.torch import Context, Task


class GPT2Task(Task):
    """A ``GPT2LMHeadModel`` of ``layers`` blocks of width ``width`` over the data ``prepare.py``
    wrote to ``data_dir`` (its vocabulary and block size are the prepared ones)."""

    def __init__(self, data_dir: str = "runs/hf_gpt2_data", width: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1, lr: float = 3e-3, weight_decay: float = 0.01, batch_size: int = 16,
                 num_workers: int = 2, eval_batch_size: int = 64) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        if not (self.data_dir / "tokenizer" / "tokenizer.json").is_file():
            raise ConfigError(f"task.params.data_dir: no prepared data in {self.data_dir}; run "
                              f"`python examples/hf_gpt2/prepare.py --out {self.data_dir}` first")
        self.width, self.layers, self.heads, self.dropout = width, layers, heads, dropout
        self.lr, self.weight_decay, self.batch_size = lr, weight_decay, batch_size
        self.num_workers, self.eval_batch_size = num_workers, eval_batch_size
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.data_dir / "tokenizer"))

    def split(self, name: str):
        """The prepared ``datasets`` split ``name`` (memory-mapped Arrow), as torch tensors."""
        from datasets import load_from_disk

        return load_from_disk(str(self.data_dir / name)).with_format("torch")

    def build_model(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        block_size = len(self.split("validation")[0]["input_ids"])
        config = GPT2Config(vocab_size=len(self.tokenizer), n_positions=block_size, n_embd=self.width,
                            n_layer=self.layers, n_head=self.heads, resid_pdrop=self.dropout,
                            embd_pdrop=self.dropout, attn_pdrop=self.dropout,
                            bos_token_id=self.tokenizer.bos_token_id, eos_token_id=self.tokenizer.eos_token_id)
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # the loss transformers would fall back to, named (it warns otherwise)
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def build_inputs(self, split: str, ctx: Context):
        if split == "train":
            from torchdata.stateful_dataloader import StatefulDataLoader
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            # Shuffled, each rank its shard, and resumable mid-epoch: the loader's state_dict
            # (sampler position, workers' progress) is saved in every checkpoint.
            blocks = self.split("train")
            sampler = StatefulDistributedSampler(blocks, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                                 seed=ctx.seed, drop_last=True)
            return StatefulDataLoader(blocks, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                                      num_workers=self.num_workers)
        return DataLoader(ctx.wrap_dataset(self.split("validation")), batch_size=self.eval_batch_size)

    def train_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss  # the model's own next-token loss

    def build_metrics(self):
        return {"accuracy": Mean()}

    def validation_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        ids = batch["input_ids"]
        output = model(input_ids=ids, labels=ids)
        correct = output.logits[:, :-1].argmax(dim=-1) == ids[:, 1:]
        return {"loss": output.loss, "accuracy": (correct.sum(), correct.numel())}  # next-token accuracy

    def tokens_per_batch(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def export_tokenizer(self):
        """The tokenizer an ``hf`` export saves beside the model."""
        return self.tokenizer
