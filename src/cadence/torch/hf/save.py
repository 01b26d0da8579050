"""The ``hf`` export format: the directory ``from_pretrained`` reads, written by the model's own
``save_pretrained`` (``config.json``, ``model.safetensors`` -- or shards and
``model.safetensors.index.json`` above ``max_shard_size`` --, ``generation_config.json`` for a model
that generates) and the Task's tokenizer's ``save_pretrained`` (:meth:`Task.export_tokenizer`)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

from torch import nn

from cadence.errors import ConfigError
from cadence.torch.hf.dependency import require_transformers
from cadence.torch.hf.models import find_pretrained
from cadence.torch.task.export_specs import SavesPretrained

__all__ = ["CONFIG_FILE", "DEFAULT_MAX_SHARD_SIZE", "check_hf_model", "load_hf_export", "write_hf"]

CONFIG_FILE = "config.json"
"""The file of an ``hf`` export that ``metadata.json`` names (``from_pretrained`` reads it first)."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Weights above this size are split into shards with an index (``transformers``' own default is larger)."""


def check_hf_model(model: nn.Module, where: str) -> nn.Module:
    """The ``transformers`` model in ``model`` (itself, or its one ``PreTrainedModel`` submodule);
    ConfigError naming ``where`` otherwise, or when ``transformers`` is not installed."""
    require_transformers(f"{where}: the 'hf' export format")
    found = find_pretrained(model)
    if found is None:
        raise ConfigError(f"{where}: the 'hf' export format needs a transformers PreTrainedModel, and "
                          f"build_model() returned a {type(model).__name__} that is not one (nor holds exactly one)")
    return found[1]


def write_hf(model: nn.Module, directory: str, tokenizer: SavesPretrained | None = None, *,
             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict[str, Any]:
    """Write ``model``'s ``transformers`` model (see :func:`check_hf_model`) with ``save_pretrained``
    into the local ``directory``, and ``tokenizer`` (when given) with its own ``save_pretrained``;
    return the metadata of the format: the model's class, the weight files, whether a generation
    config and a tokenizer were written. Tied weights are stored once (``transformers`` ties them
    again on load)."""
    hf_model = check_hf_model(model, "export")
    with _quiet_progress():
        hf_model.save_pretrained(directory, max_shard_size=max_shard_size)  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    names = sorted(os.listdir(directory))
    return {
        "model_class": type(hf_model).__name__,
        "weights": [n for n in names if n.startswith("model") and n.endswith(".safetensors")],
        "generation_config": "generation_config.json" in names,
        "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
    }


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """``transformers``' progress bars off ("Writing model shards"), as they were afterwards."""
    hf_logging = require_transformers("the 'hf' export format").utils.logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_hf_export(directory: str) -> Any:
    """The model of the ``hf`` export in the local ``directory``, by ``from_pretrained`` of the
    class its ``config.json`` names (``architectures``), offline."""
    transformers = require_transformers("loading an 'hf' export")
    with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        cls = transformers.AutoModel
    with _quiet_progress():
        return cls.from_pretrained(directory, local_files_only=True)
