"""``cadence.torch.hf.parameter_groups`` (issue 40, item 10): the Hugging Face ``Trainer``'s weight-decay
parameter groups, checked against transformers' own ``Trainer.get_decay_parameter_names`` and the grouping of
its ``create_optimizer``, on a tiny GPT-2 (LayerNorm layers, biases, a tied head) and a tiny Llama (RMSNorm
layers named ``input_layernorm`` and ``norm``), built from configs (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cadence.torch.hf import decay_parameter_names, parameter_groups  # noqa: E402


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=32, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def trainer_groups(model: torch.nn.Module, weight_decay: float) -> list[tuple[list[str], float]]:
    """What ``Trainer.create_optimizer`` groups (its own decay names; its grouping rule), by name."""
    decay = transformers.Trainer.get_decay_parameter_names(None, model)  # uses nothing of the Trainer's state
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [([n for n, _ in named if n in decay], weight_decay), ([n for n, _ in named if n not in decay], 0.0)]


def by_name(model: torch.nn.Module, groups: list[dict]) -> list[tuple[list[str], float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in groups]


@pytest.mark.parametrize("build", [gpt2, llama])
def test_the_groups_are_the_trainers(build):
    model = build()
    model.get_input_embeddings().weight.requires_grad_(False)  # a frozen parameter is in no group
    assert decay_parameter_names(model) == transformers.Trainer.get_decay_parameter_names(None, model)
    groups = parameter_groups(model, 0.1)
    assert by_name(model, groups) == trainer_groups(model, 0.1)
    decayed, others = by_name(model, groups)
    assert decayed[0] and others[0]  # both groups hold parameters: the test compares something
    assert all("bias" in n or "norm" in n or ".ln_" in n for n in others[0]), others
    torch.optim.AdamW(groups, lr=1e-3)  # what they are for


def test_gpt2_decays_its_matrices_only():
    model = gpt2()
    (decayed, _), (others, _) = by_name(model, parameter_groups(model, 0.01))
    assert "transformer.h.0.attn.c_attn.weight" in decayed and "transformer.wte.weight" in decayed
    assert "transformer.h.0.attn.c_attn.bias" in others and "transformer.ln_f.weight" in others
    assert "lm_head.weight" not in decayed + others  # tied to wte: listed once, as named_parameters does
