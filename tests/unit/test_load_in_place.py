"""Issue 29, item 4: a restore writes the optimizer state into the live optimizer's tensors
(``load_tree(into=...)``: nothing to allocate and fault in), and still refuses a corrupt file
before any byte reaches the live state."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from torch import nn

from cadence.errors import CheckpointError, CorruptCheckpointError
from cadence.torch.checkpoint_io.tensor_tree import TREE_KEY, load_tree, payload


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    payload(obj).write(buf)
    return buf.getvalue()


def adam(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def live_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def test_the_state_goes_into_the_live_optimizers_tensors():
    _, saved = adam(seed=0)
    data = to_bytes({"optimizer": saved.state_dict()})
    _, opt = adam(seed=1)  # the same shapes, other values
    before = live_tensors(opt)
    back = load_tree(data, source="x", into={"optimizer": opt.state_dict()})
    opt.load_state_dict(back["optimizer"])
    after = live_tensors(opt)
    assert [t is u for t, u in zip(before, after)] == [True] * len(before) == [True] * 16  # no new tensor
    assert all(torch.equal(t, u) for t, u in zip(after, live_tensors(saved)))


def test_what_cannot_receive_the_values_is_left_alone_and_loaded_anew():
    obj = {"shape": torch.ones(3), "dtype": torch.ones(3), "grad": torch.ones(3), "view": torch.ones(3),
           "twice": [torch.ones(3), torch.full((3,), 2.0)], "kind": torch.ones(3), "fits": torch.ones(3)}
    shared = torch.zeros(3)
    live = {"shape": torch.zeros(4), "dtype": torch.zeros(3, dtype=torch.float64),
            "grad": torch.zeros(3, requires_grad=True), "view": torch.zeros(6)[1:4], "twice": [shared, shared],
            "kind": nn.Parameter(torch.zeros(3), requires_grad=False), "fits": torch.zeros(3)}
    snapshot = {k: [t.clone() for t in v] if isinstance(v, list) else v.detach().clone() for k, v in live.items()}
    back = load_tree(to_bytes(obj), source="x", into=live)
    assert back["fits"] is live["fits"] and torch.equal(live["fits"], torch.ones(3))
    assert back["twice"][0] is shared and back["twice"][1] is not shared  # one live tensor receives one value
    assert torch.equal(shared, torch.ones(3)) and torch.equal(back["twice"][1], torch.full((3,), 2.0))
    for key in ("shape", "dtype", "grad", "view", "kind"):
        assert back[key] is not live[key] and torch.equal(back[key], obj[key]), key
        assert torch.equal(live[key], snapshot[key]), key


def forged(obj, skeleton) -> bytes:
    data = to_bytes(obj)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"][TREE_KEY] = json.dumps(skeleton)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + n:]


def test_a_malformed_structure_writes_nothing_into_the_live_tensors():
    live = {"a": torch.zeros(2)}
    data = forged({"a": torch.ones(2)}, {"a": {"$tensor": "a"}, "b": {"$tensor": "missing"}})
    with pytest.raises(CheckpointError, match="names a tensor 'missing'"):
        load_tree(data, source="x", into=live)
    assert torch.equal(live["a"], torch.zeros(2))


def _trainer(seed: int, *, steps: int = 1, model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), width: int = 4):
    """``(model, optimizer, TorchTrainer)``: ``model()``'s weights from ``seed``, ``optimizer`` (default:
    AdamW), ``steps`` steps taken on inputs of ``width``."""
    from cadence.torch import Context, TorchTrainer
    from tasks import ModelOnlyTask

    torch.manual_seed(seed)
    task = ModelOnlyTask(model, optimizer)
    built = task.build_model()
    opt = task.build_optimizer(built)
    for _ in range(steps):
        built(torch.randn(3, width)).sum().backward()
        opt.step()
    return built, opt, TorchTrainer(task, built, opt, ctx=Context.create(device="cpu"))


def test_a_corrupt_optimizer_file_leaves_the_live_trainer_untouched(tmp_path):
    """The byte flipped near the end of optimizer.safetensors (the last tensor's data) is caught
    before the model or the optimizer receives anything: the in-place load comes after verification."""
    from cadence.checkpoint import CheckpointManager

    _, _, saved = _trainer(0)
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {"trainer": saved})
    path = tmp_path / "ckpt-1" / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    model, opt, live = _trainer(1)
    weights, state = [p.detach().clone() for p in model.parameters()], [t.clone() for t in live_tensors(opt)]
    with pytest.raises(CorruptCheckpointError, match="optimizer.safetensors does not match its crc32c"):
        CheckpointManager(str(tmp_path), writer=False).restore({"trainer": live}, step=1)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(t, s) for t, s in zip(live_tensors(opt), state))


def test_a_restore_writes_into_the_live_optimizer_and_resumes_exactly(tmp_path):
    """With the trainer passing its optimizer's state to load_tree (trainer_checkpoint.py): a
    restore into a live trainer keeps the optimizer's state tensors (no new memory) and gives the
    saved values; a restore into a new trainer (no optimizer state yet) allocates them."""
    from cadence.checkpoint import CheckpointManager

    saved_model, saved_opt, saved = _trainer(0)
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {"trainer": saved})
    model, opt, live = _trainer(1)
    before = live_tensors(opt)
    manager.restore({"trainer": live}, step=1)
    assert all(t is u for t, u in zip(before, live_tensors(opt))) and len(before) == 12
    assert all(torch.equal(t, u) for t, u in zip(live_tensors(opt), live_tensors(saved_opt)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved_model.parameters()))
    fresh_model, fresh_opt, fresh = _trainer(2, steps=0)
    manager.restore({"trainer": fresh}, step=1)
    assert all(torch.equal(t, u) for t, u in zip(live_tensors(fresh_opt), live_tensors(saved_opt)))


def test_a_restore_into_a_new_optimizer_gives_the_saved_state_in_memory_of_its_own(tmp_path):
    """A resume in a new process: the optimizer has no state yet, so the load allocates it (new
    memory faulted in at once: checkpoint_io/resident.py) and it is the saved state exactly; a
    flipped byte is still caught before anything is loaded."""
    from cadence.checkpoint import CheckpointManager
    from cadence.torch.checkpoint_io.resident import MIN_BYTES

    def trainer(seed: int, steps: int):  # moments of 1.2 MiB: above resident.MIN_BYTES
        return _trainer(seed, steps=steps, model=lambda: nn.Linear(600, 512),
                        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), width=600)[2]

    saved = trainer(0, steps=2)
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {"trainer": saved})
    manager.save(2, {"trainer": saved})
    fresh = trainer(1, steps=0)
    manager.restore({"trainer": fresh}, step=1)
    loaded, expected = live_tensors(fresh.optimizer), live_tensors(saved.optimizer)
    assert len(loaded) == 6 and max(t.numel() * t.element_size() for t in loaded) > MIN_BYTES
    assert all(t.dtype == u.dtype and torch.equal(t, u) for t, u in zip(loaded, expected))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in loaded)  # its own memory
    path = tmp_path / "ckpt-2" / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a moment's bytes
    path.write_bytes(bytes(data))
    other = trainer(2, steps=0)
    with pytest.raises(CorruptCheckpointError, match="optimizer.safetensors does not match its crc32c"):
        CheckpointManager(str(tmp_path), writer=False).restore({"trainer": other}, step=2)
    assert not other.optimizer.state
