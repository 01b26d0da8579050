"""The Hugging Face ``Trainer``'s optimizer parameter groups (:func:`parameter_groups`): weight decay on
every trainable parameter but biases and normalization weights, for a Task that reproduces a
``Trainer`` run. Pure torch: ``transformers`` is not imported."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["NO_DECAY_LAYERS", "NO_DECAY_PATTERNS", "decay_parameter_names", "parameter_groups"]

NO_DECAY_LAYERS: tuple[type[nn.Module], ...] = (nn.LayerNorm,)
"""Layers none of whose parameters decay (``Trainer.get_decay_parameter_names``' forbidden types)."""

NO_DECAY_PATTERNS: tuple[str, ...] = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""Parameter names that do not decay, searched in the lower-cased dotted name (the ``Trainer``'s:
biases, and the weights of norm layers named as transformers names them, e.g. Llama's
``input_layernorm`` and ``norm``)."""

_PATTERNS = tuple(re.compile(p) for p in NO_DECAY_PATTERNS)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s parameters that weight decay applies to, as transformers'
    ``Trainer.get_decay_parameter_names(model)`` gives them: every parameter outside a
    :data:`NO_DECAY_LAYERS` layer whose name matches none of :data:`NO_DECAY_PATTERNS` (a tied
    parameter under each of its names)."""
    names: list[str] = []
    for child_name, child in model.named_children():
        if isinstance(child, NO_DECAY_LAYERS):
            continue
        names += [f"{child_name}.{n}" for n in decay_parameter_names(child)
                  if not _no_decay(f"{child_name}.{n}")]
    names += [n for n in model._parameters if not _no_decay(n)]
    return names


def _no_decay(name: str) -> bool:
    return any(p.search(name.lower()) for p in _PATTERNS)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The two parameter groups of the ``Trainer``'s ``create_optimizer``, for ``torch.optim.AdamW``:
    ``[{"params": decayed, "weight_decay": weight_decay}, {"params": the others, "weight_decay": 0.0}]``,
    each in ``model.named_parameters()`` order (a tied parameter once), trainable ones only
    (``requires_grad``). Decayed: :func:`decay_parameter_names`."""
    decay = set(decay_parameter_names(model))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in trainable if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
