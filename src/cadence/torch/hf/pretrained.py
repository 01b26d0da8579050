"""Starting from a ``save_pretrained`` directory's weights (``task.init_from_pretrained``).

The directory holds ``model.safetensors``, or shards named by ``model.safetensors.index.json``;
``save_pretrained`` leaves out the second name of a tied tensor (GPT-2's ``lm_head.weight``), which
is filled from the name it is tied to in the model. The weights are read with ``safetensors``
alone: ``transformers`` is not imported.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch
from safetensors.torch import load_file
from torch import nn

from cadence.errors import ConfigError
from cadence.torch.checkpoint_io.state import describe_key_mismatch
from cadence.torch.hf.models import find_pretrained
from cadence.torch.parallel import sharding

__all__ = ["INDEX_FILE", "WEIGHTS_FILE", "load_pretrained", "read_pretrained_state"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_pretrained_state(directory: str) -> dict[str, torch.Tensor]:
    """The weights in the ``save_pretrained`` ``directory`` (one file or the index's shards), on CPU.

    Raises ConfigError (exit 2) when the directory or its weights are missing."""
    if not os.path.isdir(directory):
        raise ConfigError(f"task.init_from_pretrained: {directory} is not a directory (expected a save_pretrained "
                          "directory, e.g. an export of format 'hf')")
    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(directory, shard)))
        return state
    if os.path.isfile(single):
        return load_file(single)
    raise ConfigError(f"task.init_from_pretrained: {directory} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def _full_state(model: nn.Module, weights: Mapping[str, torch.Tensor], directory: str) -> dict[str, torch.Tensor]:
    """``weights`` keyed as ``model``'s state dict: under the prefix of the ``transformers`` model
    inside (when ``model`` wraps one), and every tied name filled from the name it shares its tensor with."""
    found = find_pretrained(model)
    prefix = found[0] if found is not None and not set(weights) & set(model.state_dict()) else ""
    state = {prefix + k: v for k, v in weights.items()}
    expected = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    for names in by_tensor.values():  # tied: one stored name gives the others
        stored = next((n for n in names if n in state), None)
        for n in names:
            if n not in state and stored is not None:
                state[n] = state[stored]
    mismatch = describe_key_mismatch(set(expected) - set(state), set(state) - set(expected))
    if mismatch:
        raise ConfigError(f"task.init_from_pretrained: the weights in {directory} do not fit "
                          f"{type(model).__name__}: {mismatch}")
    return state


@torch.no_grad()
def load_pretrained(model: nn.Module, directory: str) -> None:
    """Load the weights of the ``save_pretrained`` ``directory`` into ``model`` (the unwrapped model;
    sharded by FSDP or not), strictly: every key of ``model``'s state dict but tied second names must
    be there, and nothing else. Ties stay (the tied tensor is loaded once, in place).

    Raises ConfigError (exit 2) for a missing directory, no weights, or weights that do not fit."""
    state = _full_state(model, read_pretrained_state(directory), directory)
    if sharding.is_sharded(model):
        sharding.load_full_model(model, state)
        return
    expected = model.state_dict(keep_vars=True)
    for name, value in state.items():
        target = expected[name]
        if target.shape != value.shape:
            raise ConfigError(f"task.init_from_pretrained: {name} in {directory} has shape {tuple(value.shape)}, "
                              f"the model's {tuple(target.shape)}")
        target.copy_(value)
