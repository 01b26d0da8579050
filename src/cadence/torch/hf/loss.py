"""The training loss of a causal language model's output (``transformers``' ``CausalLMOutput``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_loss"]

IGNORE_INDEX = -100
"""Label positions with this value count in no loss (``transformers``' convention)."""


def causal_lm_loss(output: Any, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of ``output``, a ``CausalLMOutput`` (or any output with ``loss`` / ``logits``):

    * its own ``loss`` when the model computed one (called with ``labels=``); ``labels`` is then unused;
    * else the next-token cross-entropy of ``output.logits`` (``[batch, seq, vocab]``) against
      ``labels`` (``[batch, seq]``), shifted by one as ``transformers`` does (position ``i``
      predicts token ``i + 1``), positions labelled ``-100`` left out, averaged over the rest.

    A ``train_step`` is then ``return causal_lm_loss(model(input_ids=ids, labels=ids))``.
    Raises ``ValueError`` when the output has no loss and no labels are given.
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is not None:
        return loss
    if labels is None:
        raise ValueError("causal_lm_loss: the model's output has no loss (call it with labels=...) and no labels "
                         "were given")
    logits = output["logits"] if isinstance(output, dict) else output.logits
    shifted = logits[..., :-1, :].contiguous()
    targets = labels[..., 1:].contiguous().to(shifted.device)
    return F.cross_entropy(shifted.view(-1, shifted.size(-1)).float(), targets.view(-1), ignore_index=IGNORE_INDEX)
