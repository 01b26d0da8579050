"""Inference export: every format round-trips to the live model's outputs; errors, modes, metadata,
atomic publication, fsspec stores and the ExportModel action."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence.errors import CadenceError
from cadence.export_marker import MARKER_FILE
from cadence.torch import ExportModel, Task, export_model, load_exported
from cadence.torch.export import formats as export_formats
from cadence.torch.export import writers as export_writers
from cadence.torch.export.capture import cpu_copy
from cadence.torch.export.formats import ExportDependencyError, ExportError, ExportOutputError
from cadence.torch.export.formats import TORCH_FORMATS as FORMATS  # every format of a plain module: all but hf
from cadence.torch.export.api import (
    read_export_metadata,
)

try:
    from cadence.actions import ExportFileManager
except ImportError:  # pragma: no cover - a stand-in with Orbit's semantics

    class ExportFileManager:  # type: ignore[no-redef]
        def __init__(self, base_name: str, max_to_keep: int = 5, next_id_fn: Any = None, separator: str = "-") -> None:
            self.base_name, self.max_to_keep, self.separator, self._next = base_name, max_to_keep, separator, 0

        def _ids(self) -> list[int]:
            return sorted(int(n) for n in os.listdir(self.base_name) if n.isdigit()) if os.path.isdir(self.base_name) else []

        def next_name(self) -> str:
            ids = self._ids()
            self._next = max(self._next, ids[-1] + 1 if ids else 0)
            self._next += 1
            return f"{self.base_name}{self.separator}{self._next - 1}"

        def clean_up(self) -> None:
            import shutil

            for i in self._ids()[: -self.max_to_keep]:
                shutil.rmtree(f"{self.base_name}{self.separator}{i}")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


class ConvNet(nn.Module):
    """Conv + BatchNorm (whose running stats a train-mode trace would change) + LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.norm = nn.LayerNorm(4 * 6 * 6)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(torch.nn.functional.gelu(self.norm(h)))


MODELS = {"mlp": (mlp, (8,)), "conv": (ConvNet, (1, 6, 6))}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    for m in model.modules():  # non-trivial BatchNorm statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model


def batch(name: str, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, *MODELS[name][1], generator=torch.Generator().manual_seed(seed))


def live(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory) -> dict[str, Any]:
    """Each test model exported once in every format (in train mode, to check the eval export)."""
    name = request.param
    model = build(name).train()
    directory = str(tmp_path_factory.mktemp(f"export-{name}") / "7")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = export_model(model, directory, FORMATS, example_inputs=(batch(name, 4),), metadata={"step": 7})
    return {"name": name, "model": model, "dir": directory, "paths": paths, "warnings": caught}


# -- round trips --------------------------------------------------------------------------------


def test_returns_one_path_per_format(exported):
    assert set(exported["paths"]) == set(FORMATS)
    for fmt, path in exported["paths"].items():
        assert os.path.isfile(path) and path == os.path.join(exported["dir"], export_formats.FILES[fmt])
    assert not [w for w in exported["warnings"] if "torch.jit" in str(w.message) and "deprecated" in str(w.message)]


def test_safetensors_roundtrip_is_exact(exported):
    name = exported["name"]
    fresh = build(name, seed=123)
    fresh.load_state_dict(load_exported(exported["dir"], "safetensors"))
    for n in (4, 7):
        x = batch(name, n, seed=n)
        assert torch.equal(live(fresh, x), live(exported["model"], x))


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript"])
def test_traced_torch_formats_match_with_any_batch_size(exported, fmt):
    name = exported["name"]
    loaded = load_exported(exported["dir"], fmt)
    for n in (4, 7, 2):
        x = batch(name, n, seed=10 + n)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), live(exported["model"], x), atol=1e-6, rtol=0)


def test_onnx_matches_with_any_batch_size(exported):
    name = exported["name"]
    session = load_exported(exported["dir"], "onnx")
    (inp,) = session.get_inputs()
    assert isinstance(inp.shape[0], str)  # a symbolic (dynamic) batch dimension
    for n in (4, 7, 2):
        x = batch(name, n, seed=20 + n)
        (out,) = session.run(None, {inp.name: x.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), live(exported["model"], x), atol=1e-5, rtol=0)


def test_metadata_json(exported):
    meta = read_export_metadata(exported["dir"])
    with open(os.path.join(exported["dir"], "metadata.json")) as f:
        assert json.load(f) == meta
    assert list(meta["formats"]) == list(FORMATS)
    assert {fmt: info["file"] for fmt, info in meta["formats"].items()} == {f: export_formats.FILES[f] for f in FORMATS}
    assert sorted(meta["files"]) == sorted([*(export_formats.FILES[f] for f in FORMATS), "metadata.json"])
    assert sorted(os.listdir(exported["dir"])) == sorted([*meta["files"], MARKER_FILE])
    with open(os.path.join(exported["dir"], MARKER_FILE)) as f:  # cadence's: it lists every other file
        assert json.load(f) == {"format": "cadence-export", "version": 1, "files": sorted(meta["files"])}
    assert meta["formats"]["torch_export"]["dynamic_batch"] is True
    assert meta["formats"]["onnx"]["dynamic_batch"] is True
    assert meta["formats"]["onnx"]["opset"] >= 17
    assert meta["inputs"] == [{"shape": [4, *MODELS[exported["name"]][1]], "dtype": "float32"}]
    assert meta["cadence_version"] == cadence.__version__
    assert meta["torch_version"] == torch.__version__
    assert meta["model_class"].endswith(type(exported["model"]).__qualname__)
    assert meta["step"] == 7 and meta["format_version"] == 1


def test_model_modes_restored_after_export(exported):
    fresh = build(exported["name"]).train()
    fresh_modes = [m.training for m in fresh.modules()]
    assert all(fresh_modes)
    params = dict(fresh.state_dict(keep_vars=True).items())
    before = {k: v.clone() for k, v in params.items()}
    next(iter(fresh.children())).eval()  # a frozen submodule keeps its own mode
    expected = [m.training for m in fresh.modules()]
    export_model(fresh, str(exported["dir"]) + "-modes", ["torchscript", "torch_export"],
                 example_inputs=batch(exported["name"], 3))
    assert [m.training for m in fresh.modules()] == expected
    after = fresh.state_dict(keep_vars=True)
    for k, v in after.items():
        assert v is params[k] and v.device.type == "cpu"
        assert torch.equal(v, before[k]), f"{k} changed by the export (traced in train mode?)"


# -- errors -------------------------------------------------------------------------------------


def test_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'tflite'.*safetensors, torch_export, torchscript, onnx"):
        export_model(mlp(), str(tmp_path / "x"), ["safetensors", "tflite"])
    with pytest.raises(ValueError, match="valid formats"):
        ExportModel(mlp(), ExportFileManager(str(tmp_path / "e")), ["pt"])
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript", "onnx"])
def test_missing_example_inputs(tmp_path, fmt):
    with pytest.raises(ValueError, match=f"'{fmt}'.*example inputs"):
        export_model(mlp(), str(tmp_path / "x"), ["safetensors", fmt])
    assert not os.path.exists(tmp_path / "x")


def test_task_example_inputs_default_explains():
    class NoInputs(MLPTask):
        example_inputs = Task.example_inputs

    with pytest.raises(NotImplementedError, match="NoInputs.example_inputs.*'torch_export'.*'onnx'.*batch size >= 2"):
        NoInputs().example_inputs()
    with pytest.raises(ValueError, match="'torchscript'.*example inputs"):
        ExportModel(NoInputs(), ExportFileManager("unused"), ["safetensors", "torchscript"], model_fn=mlp)


def test_missing_onnx_packages_is_a_clean_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxscript" else real(n, *a))
    with pytest.raises(ExportDependencyError, match=r"onnxscript.*pip install 'cadence\[onnx\]'") as info:
        export_model(mlp(), str(tmp_path / "x"), "onnx", example_inputs=batch("mlp", 2))
    assert isinstance(info.value, ImportError) and isinstance(info.value, CadenceError)
    assert not os.path.exists(tmp_path / "x")


def test_torchscript_of_a_none_output_says_where_and_how_to_export_the_tensors(tmp_path):
    class LogitsAndNone(nn.Module):  # nanoGPT's forward without targets: (logits, None)
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(x), None

    with pytest.raises(ExportOutputError) as info:
        export_model(LogitsAndNone(), str(tmp_path / "x"), ["torchscript"], example_inputs=(torch.zeros(2, 4),))
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None
    assert "LogitsAndNone's forward returns None at output[1]" in message
    assert "ExportSignature(lambda x: model(x)[0], example_inputs)" in message
    assert not os.path.exists(tmp_path / "x")


def test_reserved_metadata_key(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        export_model(mlp(), str(tmp_path / "x"), "safetensors", metadata={"formats": 1})


# -- publication ---------------------------------------------------------------------------------


def test_failed_export_publishes_nothing_and_keeps_the_previous(tmp_path, monkeypatch):
    directory = str(tmp_path / "export" / "5")
    export_model(mlp(), directory, "safetensors", metadata={"run": "first"})

    def boom(job, stage):
        raise ExportError("trace failed")

    monkeypatch.setitem(export_writers.WRITERS, "torchscript", boom)
    with pytest.raises(ExportError, match="trace failed"):
        export_model(mlp(), directory, ["safetensors", "torchscript"], example_inputs=batch("mlp", 2))
    assert os.listdir(tmp_path / "export") == ["5"]  # no temp dir left behind
    assert read_export_metadata(directory)["run"] == "first"
    monkeypatch.undo()
    export_model(mlp(), directory, ["torchscript"], example_inputs=batch("mlp", 2), metadata={"run": "second"})
    assert os.listdir(tmp_path / "export") == ["5"]
    assert sorted(os.listdir(directory)) == [MARKER_FILE, "metadata.json", "model.torchscript.pt"]  # replaced
    assert read_export_metadata(directory)["run"] == "second"
    with pytest.raises(ExportError, match="no 'safetensors' artefact"):
        load_exported(directory, "safetensors")


def test_incomplete_export_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ExportError, match="not a complete export"):
        load_exported(str(tmp_path), "safetensors")


def test_memory_store_safetensors():
    url = "memory://cadence-export-test/export/latest/3"
    model = build("mlp")
    paths = export_model(model, url, "safetensors", example_inputs=batch("mlp", 2), metadata={"step": 3})
    assert paths == {"safetensors": f"{url}/model.safetensors"}
    meta = read_export_metadata(url)
    assert meta["step"] == 3 and meta["inputs"] == [{"shape": [2, 8], "dtype": "float32"}]
    fresh = build("mlp", seed=5)
    fresh.load_state_dict(load_exported(url, "safetensors"))
    x = batch("mlp", 5)
    assert torch.equal(live(fresh, x), live(model, x))


def test_memory_store_torchscript_roundtrip():
    url = "memory://cadence-export-test/ts/1"
    model = build("mlp")
    export_model(model, url, ["torchscript"], example_inputs=batch("mlp", 2))
    x = batch("mlp", 3)
    with torch.no_grad():
        torch.testing.assert_close(load_exported(url, "torchscript")(x), live(model, x), atol=1e-6, rtol=0)


# -- shapes --------------------------------------------------------------------------------------


class FixedBatch(nn.Module):
    """Reshapes with a hard-coded batch size: a dynamic batch dimension cannot be exported."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(4, 2)


def test_static_fallback_when_batch_cannot_be_dynamic(tmp_path, caplog):
    model = FixedBatch()
    x = batch("mlp", 4)
    with caplog.at_level(logging.WARNING, logger="cadence.torch"):
        export_model(model, str(tmp_path / "e"), "torch_export", example_inputs=x)
    assert "static shapes" in caplog.text
    assert read_export_metadata(str(tmp_path / "e"))["formats"]["torch_export"]["dynamic_batch"] is False
    with torch.no_grad():
        torch.testing.assert_close(load_exported(str(tmp_path / "e"), "torch_export")(x), model(x), atol=1e-6, rtol=0)


def test_cpu_copy_is_independent():
    model = build("conv")
    model.head.weight.requires_grad_(False)
    copy = cpu_copy(model)
    assert all(a is not b for a, b in zip(model.parameters(), copy.parameters()))
    assert [p.requires_grad for p in copy.parameters()] == [p.requires_grad for p in model.parameters()]
    x = batch("conv", 3)
    assert torch.equal(live(copy, x), live(model, x))


# -- the action ----------------------------------------------------------------------------------


class MLPTask(Task):
    def build_model(self) -> nn.Module:
        return mlp()

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_inputs(self, split, ctx):
        return []

    def train_step(self, model, batch):
        return model(batch).sum()

    def validation_step(self, model, batch):
        return {}

    def example_inputs(self):
        return (torch.zeros(2, 8),)


class FakeController:
    def __init__(self, model: nn.Module | None = None) -> None:
        self.global_step = 0
        self.trainer = type("T", (), {"model": model})() if model is not None else None
        self.evaluator = None


def test_export_model_action_numbers_and_cleans_up(tmp_path):
    model = build("mlp")
    controller = FakeController()
    manager = ExportFileManager(str(tmp_path / "export" / "latest"), max_to_keep=2, separator="/")
    action = ExportModel(MLPTask(), manager, ("safetensors", "torchscript"), model_fn=lambda: model)
    action.attach(controller)
    written = []
    for step in (100, 200, 300):
        controller.global_step = step
        written.append(action({"accuracy": torch.tensor(step / 1000), "loss": 0.5}))
    base = str(tmp_path / "export" / "latest")
    assert written == [f"{base}/0", f"{base}/1", f"{base}/2"]
    assert sorted(os.listdir(base)) == ["1", "2"]
    meta = read_export_metadata(written[-1])
    assert meta["step"] == 300
    assert meta["metrics"] == {"accuracy": pytest.approx(0.3), "loss": 0.5}
    assert meta["inputs"] == [{"shape": [2, 8], "dtype": "float32"}]  # from Task.example_inputs
    x = batch("mlp", 6)
    with torch.no_grad():
        torch.testing.assert_close(load_exported(written[-1], "torchscript")(x), live(model, x), atol=1e-6, rtol=0)


def test_export_model_action_finds_the_controllers_model(tmp_path):
    model = build("mlp")
    controller = FakeController(model)
    controller.global_step = 40
    manager = ExportFileManager(str(tmp_path / "best"), max_to_keep=1, next_id_fn=lambda: controller.global_step, separator="/")
    action = ExportModel(MLPTask(), manager)  # safetensors only
    action.attach(controller)
    assert action({"loss": 1.0}) == str(tmp_path / "best" / "40")
    fresh = mlp()
    fresh.load_state_dict(load_exported(str(tmp_path / "best" / "40"), "safetensors"))
    assert torch.equal(fresh[0].weight, model[0].weight)
    with pytest.raises(ExportError, match="model_fn"):
        ExportModel(MLPTask(), manager)({"loss": 1.0})
