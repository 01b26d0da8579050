"""Export signatures (Task.export_signatures): one artefact set per signature under
export/<name>/<step>/<signature>/ plus signatures.json, from ModelExporter, run_export / the
`cadence export` command and the ExportModel action; every signature loads back and matches the
live one; the old layout without signatures; retention; errors naming the signature."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from cadence.actions import ExportFileManager
from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.export_marker import MARKER_FILE
from cadence.torch import (
    ExportModel,
    ExportSignature,
    export_model_signatures,
    load_exported,
    read_signatures,
)
from cadence.torch.experiments.experiment import run_training
from cadence.torch.experiments.exporting import ModelExporter
from cadence.torch.experiments.task_loader import load_task_class
from cadence.torch.export.api import read_export_metadata
from cadence.torch.export.formats import FILES, ExportError
from cadence.torch.export.formats import TORCH_FORMATS as FORMATS  # every format of a plain module: all but hf
from cadence.torch.export.signatures import check_signatures
from cli_run import run_cadence as cadence

HERE = Path(__file__).resolve().parents[1]
SIG_TASKS = HERE / "signature_tasks.py"
TINY = HERE / "tasks.py"
SIGNATURES = ["logits", "probs", "features", "margin"]


def task_class(name: str, path: Path = SIG_TASKS) -> type:
    return load_task_class(f"{path}:{name}")


def config(model_dir: Path, task: str = "SignatureTask", path: Path = SIG_TASKS, **export: Any):
    export = {"formats": ["safetensors"], "on": "final", **export}
    return config_from_dict({"model_dir": str(model_dir), "task": {"class": f"{path}:{task}"},
                             "trainer": {"train_steps": 10, "steps_per_loop": 5, "seed": 0}, "export": export})


def inputs(seed: int, n: int, count: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, 8, generator=g) for _ in range(count))


def n_inputs(name: str) -> int:
    return 2 if name == "margin" else 1


def live(task: Any, model: nn.Module, name: str, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """What the signature computes now, in eval mode, built afresh from ``model``."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return task.export_signatures(model)[name].module(*xs)
    finally:
        model.train(training)


def from_safetensors(task: Any, directory: str, name: str) -> nn.Module:
    """A fresh model carrying the signature's safetensors weights (a submodule's for features)."""
    torch.manual_seed(1234)
    fresh = task.build_model()
    state = load_exported(directory, "safetensors")
    (fresh[:2] if name == "features" else fresh).load_state_dict(state)
    return fresh


def check_roundtrip(task: Any, model: nn.Module, step_dir: str, formats: list[str]) -> None:
    """Every signature in ``step_dir`` loads back in every format and matches the live one on
    new inputs of several batch sizes."""
    for name in SIGNATURES:
        directory = os.path.join(step_dir, name)
        for n in (4, 7, 2):
            xs = inputs(10 * n + len(name), n, n_inputs(name))
            expected = live(task, model, name, xs)
            for fmt in formats:
                if fmt == "safetensors":
                    got = live(task, from_safetensors(task, directory, name), name, xs)
                    assert torch.equal(got, expected), (name, fmt)
                    continue
                loaded = load_exported(directory, fmt)
                if fmt == "onnx":
                    feeds = {i.name: x.numpy() for i, x in zip(loaded.get_inputs(), xs)}
                    assert all(isinstance(i.shape[0], str) for i in loaded.get_inputs())  # dynamic batch
                    (out,) = loaded.run(None, feeds)
                    got = torch.from_numpy(out)
                else:
                    with torch.no_grad():
                        got = loaded(*xs)
                assert got.shape == expected.shape, (name, fmt, n)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f"{name} {fmt} batch {n}")


# -- ModelExporter ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """SignatureTask's model (in train mode, with dropout) exported by ModelExporter in every format."""
    model_dir = tmp_path_factory.mktemp("sig") / "run"
    task = task_class("SignatureTask")()
    torch.manual_seed(0)
    model = task.build_model().train()
    exporter = ModelExporter(config(model_dir, formats=list(FORMATS)), task, model, "final")
    directory = exporter(10, {"metrics": {"loss": 0.5}})
    return {"task": task, "model": model, "dir": directory, "model_dir": model_dir}


def test_every_signature_dir_has_its_files(exported):
    step_dir = Path(exported["dir"])
    assert step_dir == exported["model_dir"] / "export" / "final" / "10"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([*SIGNATURES, "signatures.json", MARKER_FILE])
    for name in SIGNATURES:
        assert sorted(os.listdir(step_dir / name)) == sorted([*(FILES[f] for f in FORMATS), "metadata.json"])
        meta = read_export_metadata(str(step_dir / name))
        assert meta["signature"] == name and meta["step"] == 10 and meta["metrics"] == {"loss": 0.5}
        assert list(meta["formats"]) == list(FORMATS)
        assert meta["formats"]["torch_export"]["dynamic_batch"] is True
        assert meta["inputs"] == [{"shape": [4, 8], "dtype": "float32"}] * n_inputs(name)
    listing = read_signatures(str(step_dir))
    assert listing == json.loads((step_dir / "signatures.json").read_text())
    assert list(listing["signatures"]) == SIGNATURES
    assert {n: s["directory"] for n, s in listing["signatures"].items()} == {n: n for n in SIGNATURES}
    assert listing["formats"] == list(FORMATS) and listing["step"] == 10 and listing["metrics"] == {"loss": 0.5}
    assert "<lambda>" in listing["signatures"]["probs"]["model_class"]
    assert listing["signatures"]["logits"]["model_class"] == "torch.nn.modules.container.Sequential"
    # the model's own modes are left as they were (it was traced in eval mode)
    assert all(m.training for m in exported["model"].modules())


def test_every_signature_loads_back_and_matches_the_live_one(exported):
    check_roundtrip(exported["task"], exported["model"], exported["dir"], list(FORMATS))


def test_plain_callable_saves_the_model_weights_and_a_submodule_its_own(exported):
    model = exported["model"]
    for name in ("logits", "probs", "margin"):  # the model, and callables over it: the model's state dict
        state = load_exported(os.path.join(exported["dir"], name), "safetensors")
        assert state.keys() == model.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    features = load_exported(os.path.join(exported["dir"], "features"), "safetensors")
    assert sorted(features) == ["0.bias", "0.weight"]


def test_step_dir_is_not_an_export_itself(exported):
    with pytest.raises(ExportError, match=r"export with signatures \(logits, probs, features, margin\).*<signature>"):
        load_exported(exported["dir"], "torchscript")


def test_task_without_signatures_keeps_the_old_layout(tmp_path):
    for cls in (task_class("TinyTask", TINY), task_class("EmptySignaturesTask")):
        task = cls()
        model = task.build_model()
        exporter = ModelExporter(config(tmp_path / cls.__name__, formats=["safetensors", "torchscript"]),
                                 task, model, "best")
        directory = exporter(20, {})
        assert Path(directory) == tmp_path / cls.__name__ / "export" / "best" / "20"
        assert sorted(os.listdir(directory)) == [MARKER_FILE, "metadata.json", "model.safetensors",
                                                 "model.torchscript.pt"]
        assert "signature" not in read_export_metadata(directory)
        x = inputs(3, 5)[0]
        with torch.no_grad():
            torch.testing.assert_close(load_exported(directory, "torchscript")(x), model.eval()(x), atol=1e-6, rtol=0)


def test_retention_counts_a_step_dir_with_signatures_once(tmp_path):
    task = task_class("SignatureTask")()
    model = task.build_model()
    exporter = ModelExporter(config(tmp_path, on="every_eval", max_to_keep=2), task, model, "every_eval")
    base = tmp_path / "export" / "every_eval"
    for step in (10, 20, 30):
        with torch.no_grad():
            model[0].weight.add_(1.0)  # each export saves the weights of its time
        exporter(step, {})
    assert sorted(os.listdir(base)) == ["20", "30"]
    for step in ("20", "30"):
        assert sorted(os.listdir(base / step)) == sorted([*SIGNATURES, "signatures.json", MARKER_FILE])
    state = load_exported(str(base / "30" / "probs"), "safetensors")
    assert torch.equal(state["0.weight"], model[0].weight)


def test_run_training_exports_signatures_at_the_end(tmp_path):
    run_training(config(tmp_path / "run", formats=["safetensors", "torchscript"]), progress=False)
    step_dir = tmp_path / "run" / "export" / "final" / "10"
    assert sorted(os.listdir(step_dir)) == sorted([*SIGNATURES, "signatures.json", MARKER_FILE])
    scripted = load_exported(str(step_dir / "margin"), "torchscript")
    assert scripted(*inputs(1, 3, 2)).shape == (3, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_on_cuda_is_exported_from_a_cpu_copy(tmp_path):
    task = task_class("SignatureTask")()
    model = task.build_model().cuda().train()
    directory = ModelExporter(config(tmp_path, formats=["safetensors", "torchscript", "torch_export"]),
                              task, model, "final")(10, {})
    assert all(p.device.type == "cuda" for p in model.parameters()) and model.training
    check_roundtrip(task, model.cpu(), directory, ["safetensors", "torchscript", "torch_export"])


def test_plain_callable_over_a_model_off_cpu_is_refused(tmp_path):
    lin = nn.Linear(8, 2, device="meta")  # stands for a model on an accelerator
    with pytest.raises(ExportError, match="export signature 'probs': a plain-callable export signature is traced on CPU"):
        export_model_signatures({"probs": ExportSignature(lambda x: lin(x).softmax(-1), torch.zeros(2, 8))},
                                str(tmp_path / "e"), "torchscript", model=lin)
    assert not (tmp_path / "e").exists()


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../up", "a/b", ".", "..", "", "has space", "signatures.json", "é"])
def test_bad_signature_name(name):
    with pytest.raises(ValueError, match=f"export signature name {name!r} is not a safe directory name"):
        check_signatures({name: ExportSignature(nn.Linear(8, 2))}, ["safetensors"])


def test_good_signature_names():
    names = ["a", "serving_default", "v1.2-probs", "A_b.C-9", ".hidden"]
    assert list(check_signatures({n: ExportSignature(nn.Linear(8, 2)) for n in names}, "safetensors")) == names


def test_bad_signature_values():
    with pytest.raises(TypeError, match="export signature 'probs' must be an ExportSignature, got Linear"):
        check_signatures({"probs": nn.Linear(8, 2)}, "safetensors")
    with pytest.raises(TypeError, match="must be a mapping"):
        check_signatures([ExportSignature(nn.Linear(8, 2))], "safetensors")
    with pytest.raises(TypeError, match="module must be an nn.Module or a callable, got int"):
        ExportSignature(3)
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple of tensors"):
        ExportSignature(nn.Linear(8, 2), example_inputs={"x": torch.zeros(2, 8)})


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript", "onnx"])
def test_missing_example_inputs_for_a_traced_format_names_the_signature(tmp_path, fmt):
    sigs = {"logits": ExportSignature(nn.Linear(8, 2), (torch.zeros(2, 8),)),
            "probs": ExportSignature(lambda x: x.softmax(-1))}
    with pytest.raises(ValueError, match=f"export signature 'probs' has no example_inputs.*'{fmt}'"):
        export_model_signatures(sigs, str(tmp_path / "e"), ["safetensors", fmt])
    assert not (tmp_path / "e").exists()
    # safetensors alone needs no example inputs
    export_model_signatures(sigs, str(tmp_path / "e"), ["safetensors"])
    assert read_signatures(str(tmp_path / "e"))["signatures"]["probs"]["inputs"] is None


def test_model_exporter_refuses_bad_signatures_before_training(tmp_path):
    bad = task_class("BadNameTask")
    with pytest.raises(ConfigError, match=r"export.formats: BadNameTask.export_signatures\(\): .*'\.\./up'"):
        ModelExporter(config(tmp_path), bad(), bad().build_model(), "final")
    no_inputs = task_class("NoInputsSignatureTask")
    ModelExporter(config(tmp_path), no_inputs(), no_inputs().build_model(), "final")  # safetensors: fine
    with pytest.raises(ConfigError, match=r"NoInputsSignatureTask.export_signatures\(\): export signature 'probs' "
                                          r"has no example_inputs.*'onnx'"):
        run_training(config(tmp_path / "run", task="NoInputsSignatureTask", formats=["onnx"]), progress=False)
    assert not (tmp_path / "run" / "train").exists()  # not a single step trained


def test_failed_signature_export_names_it_and_publishes_nothing(tmp_path):
    def data_dependent(x):
        return x if float(x.sum()) > 0 else -x  # data-dependent control flow: torch.export cannot trace it

    sigs = {"ok": ExportSignature(nn.Linear(8, 2), (torch.randn(4, 8),)),
            "bad": ExportSignature(data_dependent, (torch.randn(4, 8),))}
    with pytest.raises(ExportError, match="export signature 'bad': torch.export.export failed for data_dependent"):
        export_model_signatures(sigs, str(tmp_path / "e" / "5"), ["torch_export"])
    assert os.listdir(tmp_path / "e") == []


# -- other writers -------------------------------------------------------------------------------


def test_memory_store_writes_every_signature():
    url = "memory://cadence-signature-test/export/final/3"
    lin = nn.Linear(8, 2)
    x = torch.randn(4, 8)
    sigs = {"logits": ExportSignature(lin, x), "probs": ExportSignature(lambda x: lin(x).softmax(-1), x)}
    files = export_model_signatures(sigs, url, ["safetensors", "torchscript"], model=lin, metadata={"step": 3})
    assert files["probs"]["torchscript"] == f"{url}/probs/model.torchscript.pt"
    assert read_signatures(url)["step"] == 3
    y = torch.randn(6, 8)
    with torch.no_grad():
        probs, logits = (load_exported(f"{url}/{name}", "torchscript")(y) for name in ("probs", "logits"))
        torch.testing.assert_close(probs, lin(y).softmax(-1), atol=1e-6, rtol=0)
        torch.testing.assert_close(logits, lin(y), atol=1e-6, rtol=0)
    assert load_exported(f"{url}/probs", "safetensors").keys() == {"weight", "bias"}


def test_export_model_action_writes_signatures(tmp_path):
    task = task_class("SignatureTask")()
    model = task.build_model()
    manager = ExportFileManager(str(tmp_path / "latest"), max_to_keep=1, separator="/")
    action = ExportModel(task, manager, ("safetensors", "torchscript"), model_fn=lambda: model)
    directory = action({"loss": 1.0})
    assert sorted(os.listdir(directory)) == sorted([*SIGNATURES, "signatures.json", MARKER_FILE])
    xs = inputs(5, 3, 2)
    with torch.no_grad():
        torch.testing.assert_close(load_exported(f"{directory}/margin", "torchscript")(*xs),
                                   live(task, model, "margin", xs), atol=1e-6, rtol=0)


# -- the command -----------------------------------------------------------------------------------


def test_cadence_export_command_writes_every_signature(tmp_path):
    from safetensors.torch import load_file

    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "task": {"class": f"{SIG_TASKS}:SignatureTask"},
        "trainer": {"train_steps": 10, "steps_per_loop": 5, "checkpoint_interval": 10, "seed": 0},
    }))
    model_dir = tmp_path / "run"
    proc = cadence("train", str(cfg_path), "--model-dir", str(model_dir))
    assert proc.returncode == 0, proc.stderr

    out = tmp_path / "out"
    formats = ["safetensors", "torchscript"]  # every format round-trips in the tests above
    proc = cadence("export", str(model_dir), "--checkpoint", "latest", "--format", formats[0], "--format", formats[1],
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    listed = dict(line.split("\t") for line in proc.stdout.splitlines() if "\t" in line)
    assert listed == {f"{name}/{fmt}": str(out / name / FILES[fmt]) for name in SIGNATURES for fmt in formats}
    assert sorted(os.listdir(out)) == sorted([*SIGNATURES, "signatures.json", MARKER_FILE])
    assert read_signatures(str(out))["step"] == 10

    task = task_class("SignatureTask")()
    model = task.build_model()
    model.load_state_dict(load_file(model_dir / "checkpoints" / "ckpt-10" / "model.safetensors"))
    check_roundtrip(task, model, str(out), formats)

    # a task whose signature name is bad: one line naming it, exit 2
    config_file = model_dir / "config.yaml"
    resolved = yaml.safe_load(config_file.read_text())
    resolved["task"]["class"] = f"{SIG_TASKS}:BadNameTask"
    config_file.write_text(yaml.safe_dump(resolved))
    proc = cadence("export", str(model_dir), "--checkpoint", "latest", "--format", "safetensors")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if "cadence: error:" in line]
    assert "BadNameTask.export_signatures(): export signature name '../up' is not a safe directory name" in error
