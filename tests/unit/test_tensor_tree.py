"""Optimizer / scheduler / scaler state as safetensors + a JSON structure (issue 13, item 2):
round trips of every shape optimizer state takes, exact resume, and refusal of what is malformed."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from torch import nn

from cadence.errors import CheckpointError
from cadence.torch.checkpoint_io.state import safetensors_metadata
from cadence.torch.checkpoint_io.tensor_tree import TREE_KEY, NotFlat, flatten, load_tree, payload


def to_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    payload(obj).write(buf)
    return buf.getvalue()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def adam_state():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95), amsgrad=True)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    return model, opt, {"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(), "grad_scaler": None}


def test_optimizer_scheduler_state_round_trips_exactly():
    _, _, state = adam_state()
    back = load_tree(to_bytes(state), source="ckpt-1/optimizer.safetensors")
    assert same(state, back)
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)  # tuples stay tuples
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3}  # integer keys stay integers


def test_every_leaf_kind_and_shared_tensors():
    shared = torch.arange(6.0).reshape(2, 3)
    obj = {"t": shared, "again": shared, "nan": float("nan"), "inf": -math.inf, "none": None, "flag": True,
           "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]), 7: "int key",
           (1, 2): "tuple key", "$tag": "a key like a tag", "nested": [[{"x": (1, [2.5])}]],
           "half": torch.ones(3, dtype=torch.float16), "empty": torch.zeros(0, 4), "scalar": torch.tensor(3)}
    back = load_tree(to_bytes(obj), source="x")
    assert same(obj, back)
    assert back["t"] is back["again"]  # aliases: loaded once, still shared


def test_loaded_tensors_own_their_memory():
    data = bytearray(to_bytes({"w": torch.ones(4)}))
    back = load_tree(data, source="x")
    data[:] = bytes(len(data))
    assert torch.equal(back["w"], torch.ones(4))
    back["w"].add_(1)  # writable


@pytest.mark.parametrize("value, where", [(1 + 2j, "a.b: a complex value"), (b"raw", "a.b: a bytes value"),
                                          (object(), "a.b: a object value")])
def test_what_it_cannot_represent_is_named(value, where):
    with pytest.raises(NotFlat, match=where):
        flatten({"a": {"b": value}})


def test_a_state_that_cannot_be_flattened_is_saved_with_torch_save_and_loads(tmp_path):
    from cadence.checkpoint import CheckpointManager
    from cadence.torch import Context, TorchTrainer
    from tasks import ModelOnlyTask

    class Odd(torch.optim.SGD):
        def state_dict(self):
            state = super().state_dict()
            state["note"] = 1 + 1j  # not representable: the trainer falls back to optimizer.pt
            return state

        def load_state_dict(self, state):
            assert state.pop("note") == 1 + 1j
            super().load_state_dict(state)

    task = ModelOnlyTask(lambda: nn.Linear(2, 1), lambda params: Odd(params, lr=0.1))
    model = task.build_model()
    trainer = TorchTrainer(task, model, task.build_optimizer(model), ctx=Context.create(device="cpu"))
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {"trainer": trainer})
    assert sorted(manager.manifest(1)["files"]) == ["model.safetensors", "optimizer.pt", "state.json"]
    model2 = task.build_model()
    restored = TorchTrainer(task, model2, task.build_optimizer(model2), ctx=Context.create(device="cpu"))
    manager.restore({"trainer": restored})
    assert torch.equal(model2.weight, model.weight)


def forged(skeleton) -> bytes:
    data = to_bytes({"w": torch.ones(2)})
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"][TREE_KEY] = json.dumps(skeleton)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + n:]


@pytest.mark.parametrize("skeleton, reason", [
    ({"w": {"$tensor": "nope"}}, "names a tensor 'nope' that is not in the file"),
    ({"d": {"$dtype": "save"}}, "'save' is not a torch dtype"),
    ({"d": {"$items": [[[1], 2]]}}, "malformed state structure"),
])
def test_malformed_structures_are_checkpoint_errors(skeleton, reason):
    with pytest.raises(CheckpointError, match=reason):
        load_tree(forged(skeleton), source="ckpt-3/optimizer.safetensors")
    assert TREE_KEY in safetensors_metadata(forged(skeleton))


def test_a_file_without_the_structure_is_named():
    from cadence.torch.checkpoint_io.state import state_dict_to_safetensors

    with pytest.raises(CheckpointError, match="ckpt-3/optimizer.safetensors: no 'cadence.tree'"):
        load_tree(state_dict_to_safetensors({"w": torch.ones(2)}), source="ckpt-3/optimizer.safetensors")



def test_loading_lets_go_of_the_file_bytes_at_once():
    """No reference cycle keeps views of the file alive until the garbage collector runs (a
    mapped checkpoint file would stay mapped, and deleted, its memory held)."""
    import gc

    data = bytearray(to_bytes({"w": torch.ones(4), "n": {"deep": [torch.zeros(2)]}}))
    gc.disable()
    try:
        load_tree(data, source="x")
        data.extend(b"more")  # BufferError while any view of it is alive
    finally:
        gc.enable()
