"""Tied weights (issue 27, item 1) in the safetensors files cadence writes, with the weight-tied GPT of
``tests/gpt_tasks.py``: each name of a tied tensor is in the file, so a plain
``model.load_state_dict(safetensors.torch.load_file(path))`` works; cadence's own loaders keep the
tie; files of the old format (stored once, the other names in the metadata) still load; the EMA keeps
one average per tied tensor."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from cadence.config.components.ema import EMAConfig
from cadence.torch.checkpoint_io.safetensors_io import (
    ALIASES_KEY,
    SafetensorsPayload,
    safetensors_metadata,
    state_dict_from_safetensors,
)
from cadence.torch.checkpoint_io.state import load_model_safetensors, model_to_safetensors
from cadence.torch.components.ema import EMA_FILE, ModelEMA
from gpt_tasks import TinyGPT
from in_memory import MemReader

HEAD, WTE = "lm_head.weight", "transformer.wte.weight"


def gpt(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def tied(model: TinyGPT) -> bool:
    return model.lm_head.weight is model.transformer["wte"].weight


def streamed(payload: SafetensorsPayload) -> bytes:
    buf = io.BytesIO()
    payload.write(buf)
    return buf.getvalue()


WRITERS = {
    "checkpoint": lambda m: streamed(SafetensorsPayload.from_state_dict(m.state_dict())),  # a synchronous save
    "snapshot": lambda m: streamed(SafetensorsPayload.from_state_dict(m.state_dict(), copy=True)),  # asynchronous
    "export": model_to_safetensors,  # the safetensors export
}


def old_format(model: TinyGPT) -> bytes:
    """What cadence wrote before: the tied tensor once, its other name in the metadata only."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != HEAD}
    return safetensors.torch.save(state, metadata={"format": "pt", ALIASES_KEY: json.dumps({HEAD: WTE})})


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_plain_load_state_dict_of_load_file_restores_a_tied_model(writer, tmp_path: Path) -> None:
    src = gpt(0)
    path = tmp_path / "model.safetensors"
    path.write_bytes(WRITERS[writer](src))
    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(src.state_dict())  # both names of the tied tensor
    dst = gpt(1)
    dst.load_state_dict(loaded)  # strict
    assert tied(dst)
    for key, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key], value), key
    # cadence's loaders still know the alias: one tensor under both names
    assert json.loads(safetensors_metadata(path.read_bytes())[ALIASES_KEY]) == {HEAD: WTE}


@pytest.mark.parametrize("format", ["both names", "stored once (old)"])
def test_cadences_loaders_keep_the_tie(format) -> None:
    src = gpt(0)
    data = model_to_safetensors(src) if format == "both names" else old_format(src)
    dst = gpt(1)
    load_model_safetensors(dst, data)  # resume, evaluate, the sidecar, best/ (a copy of a checkpoint)
    assert tied(dst) and torch.equal(dst.lm_head.weight, src.lm_head.weight)
    state = state_dict_from_safetensors(data)  # load_exported(directory, "safetensors")
    assert state[HEAD] is state[WTE] and torch.equal(state[HEAD], src.lm_head.weight)
    fresh = gpt(2)
    fresh.load_state_dict(state)
    assert tied(fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in src.state_dict().items())


def test_the_ema_of_a_tied_model_keeps_one_average_and_writes_a_file_a_tied_model_loads(tmp_path: Path) -> None:
    model = gpt(0)
    ema = ModelEMA(model, EMAConfig(decay=0.5))
    state = ema.averaged_state()
    assert state[HEAD] is state[WTE]
    unique_floats = {id(t) for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()}
    assert len(ema._averaged) == len(unique_floats)  # one average for the tied parameter, updated once
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    ema.on_train_step_end(None, 1)  # type: ignore[arg-type]  # the run is not read
    assert torch.equal(state[WTE], model.lm_head.weight - 0.5)  # averaged once, not twice
    path = tmp_path / EMA_FILE
    payload = ema.payload(copy=False)
    with open(path, "wb") as f:
        payload.write(f)
    averaged = gpt(1)
    averaged.load_state_dict(load_file(str(path)))  # a user's plain load of ema.safetensors
    assert tied(averaged) and torch.equal(averaged.lm_head.weight, state[WTE])
    # cadence's loader, of this file and of an old-format one: the tie's one average is restored
    for data in (path.read_bytes(), old_format(averaged)):
        restored = ModelEMA(gpt(3), EMAConfig(decay=0.5))
        restored.load_checkpoint(MemReader({"model.safetensors": b"", EMA_FILE: data}, 1))
        assert restored.averaged_state()[HEAD] is restored.averaged_state()[WTE]
        for key, value in averaged.state_dict().items():
            if value.is_floating_point():
                assert torch.equal(restored.averaged_state()[key], value), key


def test_safetensors_load_model_takes_an_export_only_when_not_strict(tmp_path):
    """What docs/guide/export.md says of ``safetensors.torch.load_model`` (issue 40, item 12), on the GPT's
    export: strict, it refuses the tied tensor's second name; ``strict=False`` loads it exactly, tie intact,
    that name returned as unexpected and nothing missing."""
    trained = gpt(0)
    path = tmp_path / "model.safetensors"
    path.write_bytes(model_to_safetensors(trained))
    with pytest.raises(RuntimeError, match=f'Unexpected key\\(s\\) in state_dict: "{WTE}"'):
        safetensors.torch.load_model(gpt(1), str(path))
    model = gpt(1)
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False)
    assert not missing and list(unexpected) == [WTE]
    assert tied(model) and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                  trained.state_dict().values()))
