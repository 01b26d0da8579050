"""RNG states as JSON, weights through safetensors (tied weights), refusal of unsafe pickles."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct

import numpy as np
import pytest
import torch
from torch import nn

from cadence.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from cadence.torch.checkpoint_io.state import (
    SafetensorsPayload,
    clone_tree,
    load_model_safetensors,
    load_torch_state,
    model_to_safetensors,
    safetensors_metadata,
    save_torch_state,
    state_dict_from_safetensors,
    state_dict_to_safetensors,
    torch_state_to_bytes,
)
from cadence.torch.runtime.rng import get_rng_state, seed_everything, set_rng_state
from cadence.torch.runtime.rng import RNGSnapshot


def draws():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [np.random.randn()],
        torch.rand(3).tolist() + torch.randn(1).tolist(),
    )


def test_rng_json_round_trip_restores_next_numbers():
    seed_everything(123)
    random.gauss(0, 1)  # leave a cached gaussian in both Python and NumPy
    np.random.randn()
    state = json.loads(json.dumps(get_rng_state()))
    expected = draws()
    seed_everything(999)
    draws()
    set_rng_state(state)
    assert draws() == expected


def test_rng_snapshot_restores():
    seed_everything(1)
    snap = RNGSnapshot()
    expected = draws()
    draws()
    snap.restore()
    assert draws() == expected


def test_seed_everything_is_deterministic():
    seed_everything(5)
    a = draws()
    seed_everything(5)
    assert draws() == a


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(2.0))


def test_tied_weights_round_trip():
    torch.manual_seed(0)
    src = Tied()
    data = model_to_safetensors(src)
    tensors = state_dict_from_safetensors(data)
    assert set(tensors) == set(src.state_dict())
    torch.manual_seed(1)
    dst = Tied()
    assert not torch.equal(dst.embed.weight, src.embed.weight)
    load_model_safetensors(dst, data)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert dst.head.weight is dst.embed.weight  # still tied after loading
    import safetensors.torch

    # under each name (a plain load_state_dict(load_file(...)) works), each its own copy in the file
    assert sorted(safetensors.torch.load(data)) == ["body.bias", "body.weight", "embed.weight", "head.weight", "scale"]


def test_views_sharing_storage_are_saved():
    base = torch.arange(10.0)
    data = torch.nn.Module()
    data.register_buffer("a", base[:5])
    data.register_buffer("b", base[5:])
    out = state_dict_from_safetensors(model_to_safetensors(data))
    assert out["a"].tolist() == [0, 1, 2, 3, 4] and out["b"].tolist() == [5, 6, 7, 8, 9]


def test_strict_loading_names_missing_and_unexpected_keys():
    data = model_to_safetensors(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)))
    with pytest.raises(CheckpointError) as e:
        load_model_safetensors(nn.Sequential(nn.Linear(2, 2)), data, source="ckpt-3/model.safetensors")
    msg = str(e.value)
    assert "ckpt-3/model.safetensors" in msg and "unexpected keys: 2.bias, 2.weight" in msg
    with pytest.raises(CheckpointError, match=r"missing keys: 1\.bias, 1\.weight"):
        load_model_safetensors(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
                               model_to_safetensors(nn.Sequential(nn.Linear(2, 2))))
    for e in (caught(nn.Sequential(nn.Linear(2, 2))), caught(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))):
        assert isinstance(e, CheckpointMismatchError) and e.exit_code == 2  # bad input: the config's model


def caught(model: nn.Module, saved: nn.Module | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        load_model_safetensors(model, model_to_safetensors(saved or nn.Sequential(nn.Linear(2, 2), nn.ReLU(),
                                                                                   nn.Linear(2, 1))))
    return e.value


def test_a_model_of_another_size_is_one_line_naming_the_first_tensor_and_both_shapes():
    """Not torch's load_state_dict text (a line per tensor): the first one, both shapes, how many more
    (issue 39); exit 2, and the model is left as it was."""
    def mlp(hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    model = mlp(64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    e = caught(model, mlp(16))
    assert isinstance(e, CheckpointMismatchError) and e.exit_code == 2
    assert str(e) == ("model.safetensors does not match the model (Sequential): '0.weight' has shape (16, 8) in the "
                      "checkpoint, (64, 8) in the model (and 2 more tensors differ in shape)")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing loaded
    assert str(caught(nn.Linear(3, 2), nn.Linear(2, 2))) == (
        "model.safetensors does not match the model (Linear): 'weight' has shape (2, 2) in the checkpoint, (2, 3) "
        "in the model")
    assert str(caught(nn.Linear(3, 3), nn.Linear(2, 2))).endswith("(and 1 more tensor differs in shape)")


def test_optimizer_state_round_trip():
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    blob = torch_state_to_bytes({"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(), "grad_scaler": None})
    back = load_torch_state(blob)
    assert back["lr_scheduler"] == sched.state_dict()
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("container", ["zip", "raw-pickle"])
def test_malicious_optimizer_file_is_refused_and_never_runs(tmp_path, container):
    marker = tmp_path / "MARKER"
    payload = {"optimizer": Evil(str(marker))}
    if container == "zip":
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
    else:
        data = pickle.dumps(payload, protocol=2)
    with pytest.raises(UnsafeCheckpointError) as e:
        load_torch_state(data, name="optimizer.pt", source="/runs/x/checkpoints/ckpt-7")
    msg = str(e.value)
    assert "/runs/x/checkpoints/ckpt-7/optimizer.pt" in msg and "arbitrary unpickling" in msg
    assert not marker.exists()


def test_unloadable_state_is_refused_at_save_time():
    with pytest.raises(CheckpointError, match="weights_only"):
        torch_state_to_bytes({"lr_scheduler": {"fn": Evil("/nonexistent/never")}})


def test_garbage_optimizer_file_is_a_checkpoint_error():
    with pytest.raises(CheckpointError):
        load_torch_state(b"PK\x03\x04 not really a zip")


# -- streaming writers (no in-memory copy of the file) -----------------------------------------


class Count(int):
    """An int subclass: not plainly loadable, and ``torch.load(weights_only=True)`` refuses it."""


def _streamed(payload: SafetensorsPayload) -> bytes:
    buf = io.BytesIO()
    payload.write(buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_streamed_safetensors_reads_back_with_the_library(dtype, tmp_path):
    import safetensors
    import safetensors.torch

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": (torch.randn(3, 5, generator=g) * 10).to(dtype),
        "scalar": torch.tensor(3).to(dtype),
        "empty": torch.zeros(0, 2).to(dtype),
        "byte": torch.arange(7, dtype=torch.uint8),  # a 1-byte dtype beside a wider one: alignment
        "wide": torch.arange(5, dtype=torch.float64),
    }
    data = _streamed(SafetensorsPayload.from_state_dict(tensors, {"note": "x"}))
    loaded = safetensors.torch.load(data)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    assert safetensors_metadata(data)["note"] == "x"
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), "pt") as f:  # the memory-mapped reader accepts it too
        assert torch.equal(f.get_tensor("w"), tensors["w"])


def test_streamed_safetensors_keeps_tied_weights_under_each_name():
    src = Tied()
    data = _streamed(SafetensorsPayload.from_state_dict(src.state_dict()))
    dst = Tied()
    load_model_safetensors(dst, data)
    assert torch.equal(dst.head.weight, src.embed.weight) and dst.head.weight is dst.embed.weight
    import safetensors.torch

    assert torch.equal(safetensors.torch.load(data)["head.weight"], src.embed.weight)


def test_a_dtype_the_streaming_writer_does_not_map_goes_through_the_library():
    t = torch.randn(4).to(torch.float8_e4m3fn)
    data = _streamed(SafetensorsPayload.from_state_dict({"f8": t}))
    back = state_dict_from_safetensors(data)["f8"]
    assert back.dtype == torch.float8_e4m3fn and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_payload_copy_snapshots_the_tensors():
    model = nn.Linear(2, 2)
    shared = SafetensorsPayload.from_state_dict(model.state_dict())
    copied = SafetensorsPayload.from_state_dict(model.state_dict(), copy=True)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(copied.tensors["weight"], before)  # a snapshot: unaffected by training
    assert torch.equal(shared.tensors["weight"], model.weight)  # no copy: the live tensor


def test_save_torch_state_streams_plain_state_and_refuses_unsafe_state_before_writing():
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    save_torch_state(buf, {"optimizer": opt.state_dict()})
    back = load_torch_state(buf.getvalue())
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    unsafe = io.BytesIO()
    with pytest.raises(CheckpointError, match="weights_only"):
        save_torch_state(unsafe, {"optimizer": opt.state_dict(), "extra": Evil("/nonexistent/never")})
    assert unsafe.getvalue() == b""  # refused before a byte was written


def test_save_torch_state_checks_types_it_does_not_know_by_loading_them_back():
    with pytest.raises(CheckpointError, match="weights_only"):
        save_torch_state(io.BytesIO(), {"n": Count(3)})
    param_state = {"p": nn.Parameter(torch.ones(2))}  # not a plain tensor, but weights_only loads it
    buf = io.BytesIO()
    save_torch_state(buf, param_state)
    assert torch.equal(load_torch_state(buf.getvalue())["p"], torch.ones(2))


def test_clone_tree_copies_tensors_and_rebuilds_containers():
    t = torch.ones(3)
    tree = {"a": [t, (t, 2)], "b": "x"}
    out = clone_tree(tree)
    t.add_(1)
    assert out["a"][0].tolist() == [1, 1, 1] and out["a"][1][0].tolist() == [1, 1, 1]
    assert out["a"][1][1] == 2 and out["b"] == "x" and isinstance(out["a"][1], tuple)


def test_loading_copies_once_from_views_of_the_file_bytes():
    """Issue 13: the model's tensors are views of the verified bytes (no intermediate copy) and
    are copied once into the parameters; the parameters own their memory afterwards."""
    from cadence.torch.checkpoint_io.state import safetensors_views

    src = Tied()
    data = bytearray(model_to_safetensors(src))
    views = safetensors_views(data)
    lo = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    hi = lo + len(data)
    assert all(lo <= v.data_ptr() < hi for v in views.values() if v.numel())  # inside the buffer
    assert views["head.weight"] is views["embed.weight"]
    dst = Tied()
    load_model_safetensors(dst, data)
    data[:] = bytes(len(data))  # the buffer may be reused: the model keeps its values
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


@pytest.mark.parametrize("tamper, reason", [
    (lambda h: h["w"].update(data_offsets=[0, 10**9]), "bad data_offsets"),
    (lambda h: h["w"].update(shape=[3, -1]), "bad shape"),
    (lambda h: h["w"].update(shape=[5]), "do not hold shape"),
    (lambda h: h["b"].update(data_offsets=h["w"]["data_offsets"][:1] + [h["w"]["data_offsets"][0] + 8]),
     "overlap"),
    (lambda h: h.update(w=[1, 2]), "is not an object"),
])
def test_view_reader_refuses_bad_headers(tamper, reason):
    from cadence.torch.checkpoint_io.state import safetensors_views

    data = state_dict_to_safetensors({"w": torch.ones(2, 3), "b": torch.zeros(2)})
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    tamper(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    forged = struct.pack("<Q", len(encoded)) + encoded + data[8 + n:]
    with pytest.raises(CheckpointError, match=reason):
        safetensors_views(forged)
    with pytest.raises(CheckpointError, match="bad header length"):
        safetensors_views(struct.pack("<Q", 2**62) + data[8:])
