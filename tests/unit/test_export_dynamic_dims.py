"""Declared dynamic dimensions and ONNX names (``Task.export_spec``, ``ExportSpec``): a language
model exported at length 32 runs at other lengths in the ``.pt2`` and in onnxruntime."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from cadence.torch import ExportSignature, ExportSpec, export_model, export_model_signatures, load_exported
from cadence.torch.export.api import export_task_model
from cadence.torch.export.dynamic_shapes import check_spec
from cadence.torch.export.formats import ExportError

from cadence.torch.experiments.task_loader import load_task_class

CharLMTask = load_task_class(f"{Path(__file__).resolve().parents[2] / 'examples' / 'charlm' / 'task.py'}:CharLMTask")

HAS_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))


@pytest.fixture(scope="module")
def charlm():
    torch.manual_seed(0)
    task = CharLMTask(seq_len=32, d_model=16, heads=2, layers=1, ff=32, train_samples=8, validation_samples=8)
    return task, task.build_model().eval()


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx, onnxscript and onnxruntime")
def test_a_language_model_exported_at_length_32_runs_at_16_in_the_pt2_and_onnxruntime(charlm, tmp_path):
    task, model = charlm
    assert task.example_inputs()[0].shape == (2, 32)
    out = tmp_path / "export"
    export_task_model(task, model, str(out), ["torch_export", "onnx"])
    program, session = load_exported(str(out), "torch_export"), load_exported(str(out), "onnx")
    assert [i.name for i in session.get_inputs()] == ["tokens"] and [o.name for o in session.get_outputs()] == ["logits"]
    assert session.get_inputs()[0].shape == ["batch", "seq"]  # ONNX names the dimensions as declared
    for shape in ((3, 16), (1, 5), (2, 32)):
        x = torch.randint(0, 13, shape)
        with torch.no_grad():
            eager = model(x)
        assert eager.shape == (*shape, 13)
        torch.testing.assert_close(program(x), eager, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"tokens": x.numpy()})[0]), eager,
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="32"):  # the declared bound: 32 positions
        program(torch.randint(0, 13, (2, 33)))
    meta = json.loads((out / "metadata.json").read_text())
    for fmt in ("torch_export", "onnx"):
        (dims,) = meta["formats"][fmt]["dynamic_dims"]  # one input: {dim: {name, min, max}}
        assert dims["0"]["name"] == "batch" and dims["1"] == {"name": "seq", "min": 1, "max": 32}
        assert meta["formats"][fmt]["dynamic_batch"] is True


def test_the_default_keeps_only_the_batch_dynamic(charlm, tmp_path):
    _, model = charlm
    out = tmp_path / "default"
    export_model(model, str(out), "torch_export", example_inputs=(torch.randint(0, 13, (2, 32)),))
    program = load_exported(str(out), "torch_export")
    torch.testing.assert_close(program(torch.randint(0, 13, (5, 32))).shape, torch.Size([5, 32, 13]))
    with pytest.raises(Exception, match="32"):  # noqa: B017 - torch's guard error: the length was fixed at 32
        program(torch.randint(0, 13, (2, 16)))
    meta = json.loads((out / "metadata.json").read_text())["formats"]["torch_export"]
    assert meta["dynamic_batch"] is True and list(meta["dynamic_dims"][0]) == ["0"]


def test_two_inputs_share_a_named_dimension_in_a_signature(tmp_path):
    model = nn.Linear(4, 3).eval()
    add = ExportSignature(lambda a, b: model(a + b),
                          (torch.zeros(2, 6, 4), torch.ones(2, 6, 4)),
                          spec=ExportSpec(dynamic_dims=[{0: "batch", 1: "n"}, {0: "batch", 1: "n"}]))
    export_model_signatures({"add": add}, str(tmp_path / "sig"), "torch_export", model=model)
    program = load_exported(str(tmp_path / "sig" / "add"), "torch_export")
    a, b = torch.randn(3, 9, 4), torch.randn(3, 9, 4)
    torch.testing.assert_close(program(a, b), model(a + b))


def test_declared_dimensions_the_model_fixes_fail_naming_them(tmp_path):
    model = nn.Linear(8, 3)
    spec = ExportSpec(dynamic_dims=[{0: "batch", 1: "features"}])
    with pytest.raises(ExportError, match=r"declared dynamic dimensions .*'features'"):
        export_model(model, str(tmp_path / "e"), "torch_export", example_inputs=(torch.zeros(2, 8),), spec=spec)
    assert not (tmp_path / "e").exists()  # never a silent static fallback, nothing published


@pytest.mark.parametrize("spec, inputs, message", [
    (ExportSpec(dynamic_dims=[{0: "batch"}]), (torch.zeros(2, 3), torch.zeros(2, 3)), "1 entries for 2 example inputs"),
    (ExportSpec(dynamic_dims=[{2: "seq"}]), (torch.zeros(2, 3),), r"\[0\]\[2\]: example input 0 has 2 dims"),
    (ExportSpec(dynamic_dims=[{1: ("seq", 1, 8)}]), (torch.zeros(2, 16),), r"size 16 there, outside 'seq''s bounds"),
    (ExportSpec(dynamic_dims=[{1: "seq"}]), (torch.zeros(2, 1),), "size 1 in example input 0"),
    (ExportSpec(dynamic_dims=[{0: ("b", 1, 8)}, {0: ("b", 1, 9)}]), (torch.zeros(2), torch.zeros(2)), "two|bounds"),
    (ExportSpec(input_names=["a", "b"]), (torch.zeros(2, 3),), "names 2 inputs"),
])
def test_a_spec_that_does_not_fit_the_example_inputs_is_named(spec, inputs, message):
    with pytest.raises(ValueError, match=message):
        check_spec(spec, inputs)


def test_malformed_specs():
    with pytest.raises(TypeError, match="one entry per input"):
        ExportSpec(dynamic_dims={0: "batch"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a name"):
        ExportSpec(dynamic_dims=[{0: ("batch", 1)}])
    with pytest.raises(ValueError, match="min 9 is above max 2"):
        ExportSpec(dynamic_dims=[{0: ("batch", 9, 2)}])
    with pytest.raises(ValueError, match="duplicate"):
        ExportSpec(output_names=["y", "y"])


class MisdeclaredTask(CharLMTask):
    """The charlm task declaring a third dim its inputs do not have."""

    def __init__(self) -> None:
        super().__init__(seq_len=8, d_model=8, heads=2, layers=1, ff=8, train_samples=8, validation_samples=8)

    def export_spec(self) -> ExportSpec:
        return ExportSpec(dynamic_dims=[{0: "batch", 2: "depth"}])


def test_a_config_driven_run_checks_the_spec_before_training(tmp_path):
    from cadence.config import config_from_dict
    from cadence.errors import ConfigError
    from cadence.torch import run_training

    cfg = config_from_dict({"model_dir": str(tmp_path / "run"), "task": {"class": f"{__file__}:MisdeclaredTask"},
                            "trainer": {"train_steps": 2, "steps_per_loop": 1},
                            "export": {"formats": ["torch_export"], "on": "final"}})
    with pytest.raises(ConfigError, match=r"export.formats: MisdeclaredTask.export_spec\(\): .*\[0\]\[2\]: example "
                                          r"input 0 has 2 dims"):
        run_training(cfg, progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/ckpt-*")) and not (tmp_path / "run" / "train").exists()
