"""Finding the ``transformers`` model in what a Task's ``build_model`` returned."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["find_pretrained", "is_pretrained_model"]


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (without importing ``transformers``:
    a module that is one has imported it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def find_pretrained(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(prefix, module)``: ``model`` itself (prefix ``""``) when it is a ``PreTrainedModel``, else
    its one outermost ``PreTrainedModel`` submodule (prefix ``"name."``: its keys in ``model``'s
    state dict start so); ``None`` when there is none, or several (which one would be the model?)."""
    if is_pretrained_model(model):
        return "", model
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if is_pretrained_model(module) and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    if len(found) != 1:
        return None
    name, module = found[0]
    return f"{name}.", module
