"""Sharded checkpoints, the torch half, in one process without a process group: DCP checkpoints
are read exactly (``read_model_state``, ``load_model``) and safely -- a ``.metadata`` or a value
that needs arbitrary unpickling is refused with ``UnsafeCheckpointError`` before any of its code
runs -- and ``describe`` makes one line of DCP's per-rank failures."""

from __future__ import annotations

import builtins
import os
import pickle
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from cadence.checkpoint import checksum as checksum_lib
from cadence.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from cadence.torch.checkpoint_io import sharded as sc

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming ... a single process"

METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2, bias=False).to(torch.bfloat16)
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64) * 3)


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def save_dcp(state: dict[str, Any], directory: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory))
    return directory


@dataclass
class Hyper:
    """A harmless object of an arbitrary class: still not loadable without arbitrary unpickling."""

    lr: float = 0.1


class RunsCode:
    """Unpickling this runs ``os.system``: creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Evals:
    """Unpickling this calls ``builtins.eval``: creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Net, Path]:
    model = net(0)
    return model, save_dcp({"model": get_model_state_dict(model)}, tmp_path / "ckpt")


# == (c) exact reads ==============================================================================


def test_read_model_state_is_the_modules_state_dict_bit_for_bit(saved) -> None:
    model, directory = saved
    state = sc.read_model_state(str(directory))
    expected = model.state_dict()
    assert sorted(state) == sorted(expected)
    assert {t.dtype for t in state.values()} == {torch.float32, torch.bfloat16, torch.int64}
    for name, tensor in expected.items():
        got = state[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and got.device.type == "cpu", name
        assert torch.equal(got.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_load_model_into_a_fresh_module_gives_the_same_parameters(saved) -> None:
    model, directory = saved
    fresh = net(1)
    assert not torch.equal(fresh.lin.weight, model.lin.weight)
    sc.load_model(str(directory), fresh)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2)


class Narrower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)


class Reshaped(Net):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)


@pytest.mark.parametrize("module, match", [
    (Wider, r"missing keys: extra\.bias, extra\.weight$"),  # strict as model.safetensors: not left at its init
    (Narrower, r"unexpected keys: counts, embed\.weight, head\.weight$"),
    (Reshaped, r": the model state does not match this model: 'lin\.weight' has shape \(3, 4\) in the checkpoint, "
               r"\(5, 4\) in the model \(and 1 more tensor differs in shape\)$"),
])
def test_load_model_into_a_module_that_does_not_match_is_one_line_of_bad_input(saved, module, match: str) -> None:
    """A model the checkpoint does not fit (keys or shapes) is bad input (exit 2), in one line naming the
    first tensor and both shapes, found before anything is read."""
    _, directory = saved
    target = module()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=match) as e:
        sc.load_model(str(directory), target)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_load_trainer_state_without_a_scheduler_refuses_a_model_with_more_layers(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    directory = save_dcp(sc.trainer_state(model, torch.optim.SGD(model.parameters(), lr=0.1), None), tmp_path / "c")
    wider = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing keys: 1\.bias, 1\.weight"):
        sc.load_trainer_state(str(directory), wider, torch.optim.SGD(wider[0].parameters(), lr=0.1), None)


def test_read_model_state_of_a_checkpoint_without_a_model_is_a_checkpoint_error(tmp_path: Path) -> None:
    directory = save_dcp({"other": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds no model state"):
        sc.read_model_state(str(directory))


def test_write_shards_reports_every_file_it_wrote_with_its_checksum(tmp_path: Path) -> None:
    model = net(2)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = sc.write_shards({"model": get_model_state_dict(model)}, str(directory), algorithm="sha256")
    assert sorted(files) == sorted(os.listdir(directory)) and sc.METADATA_FILE in files
    for name, (size, digest) in files.items():
        data = (directory / name).read_bytes()
        assert size == len(data) and digest == checksum_lib.checksum_of("sha256", data)
    assert sc.is_sharded_checkpoint(sorted(files)) and not sc.is_sharded_checkpoint(["model.safetensors"])
    state = sc.read_model_state(str(directory))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


# == (b) non-tensor values ========================================================================


def test_plain_values_load(tmp_path: Path) -> None:
    directory = save_dcp({"extra": {"lr": 0.25, "betas": [0.9, 0.99], "name": "adam", "steps": 7}}, tmp_path / "c")
    state: dict[str, Any] = {"extra": {"lr": None, "betas": None, "name": None, "steps": None}}
    sc._load(state, str(directory), None, allow_partial=True)
    assert state == {"extra": {"lr": 0.25, "betas": [0.9, 0.99], "name": "adam", "steps": 7}}


def test_a_value_of_an_arbitrary_class_is_refused(tmp_path: Path) -> None:
    directory = save_dcp({"extra": {"lr": 0.25, "hyper": Hyper(0.5)}}, tmp_path / "c")
    state: dict[str, Any] = {"extra": {"hyper": None}}
    with pytest.raises(UnsafeCheckpointError, match=r"'extra\.hyper' needs unsafe unpickling"):
        sc._load(state, str(directory), None, allow_partial=True)
    assert state == {"extra": {"hyper": None}}
    # the plain value beside it still loads
    plain: dict[str, Any] = {"extra": {"lr": None}}
    sc._load(plain, str(directory), None, allow_partial=True)
    assert plain == {"extra": {"lr": 0.25}}


@pytest.mark.parametrize("evil", [RunsCode, Evals])
def test_a_value_that_runs_code_when_unpickled_is_refused_before_it_runs(tmp_path: Path, evil) -> None:
    marker = tmp_path / "pwned"
    directory = save_dcp({"extra": {"payload": evil(marker)}}, tmp_path / "c")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="payload"):
        sc._load({"extra": {"payload": None}}, str(directory), None, allow_partial=True)
    assert not marker.exists()


def test_load_trainer_state_refuses_an_unsafe_scheduler_state(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    marker = tmp_path / "pwned"
    state = sc.trainer_state(model, optimizer, scheduler)
    state["lr_scheduler"]["step_size"] = RunsCode(marker)
    directory = save_dcp(state, tmp_path / "c")
    model2 = nn.Linear(3, 2)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with pytest.raises(UnsafeCheckpointError, match=r"lr_scheduler\.step_size"):
        sc.load_trainer_state(str(directory), model2, optimizer2, torch.optim.lr_scheduler.StepLR(optimizer2, 3))
    assert not marker.exists()


def test_load_trainer_state_round_trips_a_safe_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    directory = save_dcp(sc.trainer_state(model, optimizer, scheduler), tmp_path / "c")
    torch.manual_seed(4)
    model2 = nn.Linear(3, 2)
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=3)
    sc.load_trainer_state(str(directory), model2, optimizer2, scheduler2)
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert optimizer2.param_groups[0]["betas"] == (0.8, 0.9)  # a tuple again
    assert scheduler2.state_dict() == scheduler.state_dict()
    exp_avg = optimizer.state[model.weight]["exp_avg"]
    assert torch.equal(optimizer2.state[model2.weight]["exp_avg"], exp_avg)


# == (a) .metadata ================================================================================


def original_metadata(directory: Path) -> Any:
    """DCP's own (unrestricted) reading of a checkpoint we wrote ourselves."""
    return FileSystemReader(str(directory)).read_metadata()


@pytest.mark.parametrize("evil", [RunsCode, Evals])
@pytest.mark.parametrize("load", ["read_model_state", "load_model"])
def test_metadata_that_runs_code_is_refused_before_it_runs(saved, tmp_path: Path, evil, load: str) -> None:
    _, directory = saved
    marker = tmp_path / "pwned"
    metadata = original_metadata(directory)
    metadata.planner_data = evil(marker)  # an Any field: whatever the pickle holds
    (directory / sc.METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata refers to (posix\.system|builtins\.eval)"):
        if load == "read_model_state":
            sc.read_model_state(str(directory))
        else:
            sc.load_model(str(directory), net(1))
    assert not marker.exists()


def stack_global_call(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle of ``module.name(argument)``, the global looked up by STACK_GLOBAL
    (which resolves a dotted ``name`` attribute by attribute)."""

    def unicode(text: str) -> bytes:
        data = text.encode()
        return b"\x8c" + bytes([len(data)]) + data + b"\x94"  # SHORT_BINUNICODE, MEMOIZE

    return b"\x80\x04" + unicode(module) + unicode(name) + b"\x93" + unicode(argument) + b"\x85R."


@pytest.mark.parametrize("module, name", [
    (METADATA_MODULE, "os.system"),  # a dotted name through the allowed module to what it imports
    ("pathlib", "PosixPath.os.system"),  # ... and through an allowed class
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "getoutput"),
])
def test_metadata_reaching_a_function_through_an_allowed_name_is_refused(saved, tmp_path: Path,
                                                                          module: str, name: str) -> None:
    _, directory = saved
    marker = tmp_path / "pwned"
    (directory / sc.METADATA_FILE).write_bytes(stack_global_call(module, name, f"touch {marker}"))
    with pytest.raises(UnsafeCheckpointError, match="not part of DCP's metadata"):
        sc.read_model_state(str(directory))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os", "torch", "field", "dataclass"])
def test_metadata_naming_what_the_metadata_module_imports_is_refused(saved, name: str) -> None:
    """Only DCP's metadata classes are taken from its module, not the modules and functions it imports."""
    _, directory = saved
    data = b"\x80\x04\x8c" + bytes([len(METADATA_MODULE)]) + METADATA_MODULE.encode() + b"\x94" \
        + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x94\x93."
    (directory / sc.METADATA_FILE).write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="not part of DCP's metadata"):
        sc.read_model_state(str(directory))


def test_metadata_that_is_not_dcp_metadata_is_a_checkpoint_error(saved) -> None:
    _, directory = saved
    (directory / sc.METADATA_FILE).write_bytes(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        sc.read_model_state(str(directory))


def test_the_real_metadata_unpickles_with_the_allowlist(saved) -> None:
    _, directory = saved
    with open(directory / sc.METADATA_FILE, "rb") as f:
        metadata = sc._MetadataUnpickler(f, "x").load()
    assert type(metadata).__module__ == METADATA_MODULE and type(metadata).__name__ == "Metadata"
    assert metadata.state_dict_metadata == original_metadata(directory).state_dict_metadata


# == (d) describe =================================================================================


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - with a traceback, as DCP wraps them
        return e


def test_describe_lists_each_failing_rank_in_one_line() -> None:
    failures = {
        3: _wrap_exception(raised(OSError("No space left on device\nmore detail"))),
        0: _wrap_exception(raised(ValueError("bad shard"))),
        1: (RuntimeError(""), traceback.StackSummary()),
    }
    text = sc.describe(CheckpointException("save", failures))
    assert "\n" not in text
    assert text == "rank 0: ValueError: bad shard; rank 1: RuntimeError; rank 3: OSError: No space left on device"


def test_describe_of_a_plain_exception_is_its_first_line() -> None:
    assert sc.describe(KeyError("model.w")) == "KeyError: 'model.w'"
    assert sc.describe(RuntimeError("first\nsecond")) == "RuntimeError: first"


def test_a_failed_load_names_the_rank_and_the_cause(saved) -> None:
    _, directory = saved
    for shard in directory.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"cannot load the sharded checkpoint: rank 0: FileNotFoundError") as e:
        sc.read_model_state(str(directory))
    assert "\n" not in str(e.value) and not isinstance(e.value, UnsafeCheckpointError)


def test_the_stager_stages_again_a_state_holding_objects_rebuilt_from_their_reduction() -> None:
    """With torch 2.11 a DCP stager's deep-copy table was empty after each stage: the second save of an
    FSDP2 state on CUDA failed with ``KeyError: <class 'type'>`` (seen on an H100 and an H200). ``stage``
    puts the table back before each stage."""
    from cadence.torch.checkpoint_io.sharded import stage

    @dataclass
    class Spec:  # rebuilt by the stager from its reduction, whose arguments hold its class
        placement: int

    state = {"w": torch.arange(4.0), "spec": Spec(1)}
    staged, stager = stage(state)
    table = stager._state_dict_stager._deepcopy_dispatch
    table.pop(type, None)  # as torch 2.11 left it
    with pytest.raises(KeyError):
        stager.stage(dict(state))
    for _ in range(2):  # torch 2.11 empties the table at every stage: each one puts it back
        state["w"] += 1
        table.clear()
        again, same = stage(state, stager)
        assert same is stager and again["spec"] == Spec(1) and torch.equal(again["w"], state["w"])
    assert staged["spec"] == Spec(1)
    stager.close()
