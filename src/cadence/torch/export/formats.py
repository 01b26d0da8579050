"""The export formats (:data:`FORMATS`), their files, the checks of a list of formats, and the errors an
export raises. Each format is a file in the export directory (written by :mod:`cadence.torch.export.writers`):

* ``safetensors`` -- ``model.safetensors``: the (unwrapped) model's state dict; load it into a
  freshly built model.
* ``torch_export`` -- ``model.pt2``: ``torch.export.export`` with the dynamic dimensions of the
  :class:`ExportSpec` (by default a dynamic batch dimension; static shapes, with a warning, when
  that fails), saved with ``torch.export.save``.
* ``torchscript`` -- ``model.torchscript.pt``: ``torch.jit.trace`` of the model in eval mode (a
  trace cannot declare dynamic dimensions: shapes the model computes with in Python are recorded
  as constants).
* ``onnx`` -- ``model.onnx``: the ``torch.export`` graph through ``torch.onnx.export`` (the dynamo
  exporter, at its recommended opset), with the spec's dynamic dimensions (named as declared) and
  input / output names, checked with ``onnx.checker``. Needs ``onnx`` and ``onnxscript`` (``pip
  install 'cadence[onnx]'``; loading it back also needs ``onnxruntime``).
* ``hf`` -- the directory ``from_pretrained`` reads, for a ``transformers`` model: ``config.json``,
  ``model.safetensors`` (or shards and their index), ``generation_config.json``, and the Task's
  tokenizer files (:mod:`cadence.torch.hf.save`; ``pip install 'cadence[hf]'``). It writes its own
  ``model.safetensors`` (tied names once), so it does not combine with ``safetensors``.

The traced formats need example inputs (``model(*example_inputs)``, batch dimension first, batch
size >= 2). Every export writes ``metadata.json`` last: formats and files, cadence and torch
versions, input shapes and dtypes, and the caller's metadata (step, metrics, ...).
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

from cadence.config.schema import EXPORT_FORMATS
from cadence.errors import CadenceError
from cadence.torch.checkpoint_io.state import MODEL_FILE
from cadence.torch.hf.save import CONFIG_FILE

__all__ = ["FILES", "FORMATS", "TORCH_FORMATS", "TRACED_FORMATS", "ExportDependencyError", "ExportError", "ExportOutputError",
           "check_formats",
           "missing_inputs_error", "require_modules", "require_onnx", "traced_formats"]

FORMATS: tuple[str, ...] = EXPORT_FORMATS
"""The export formats (the config schema's list), in the order of the module docstring."""
TORCH_FORMATS: tuple[str, ...] = tuple(f for f in FORMATS if f != "hf")
"""The formats any ``nn.Module`` is exported to together (``hf`` needs a ``transformers`` model and
writes its own ``model.safetensors``)."""
TRACED_FORMATS = frozenset({"torch_export", "torchscript", "onnx"})
"""Formats that run the model on example inputs."""
FILES: dict[str, str] = {
    "safetensors": MODEL_FILE,
    "torch_export": "model.pt2",
    "torchscript": "model.torchscript.pt",
    "onnx": "model.onnx",
    "hf": CONFIG_FILE,
}
"""The artefact file of each format."""
_ONNX_INSTALL = "pip install 'cadence[onnx]'"


class ExportError(CadenceError):
    """An export could not be written, or an exported artefact could not be read back."""


class ExportOutputError(ExportError):
    """The model's outputs cannot be written in a format (a ``None`` output for ``torchscript``);
    the message says where and how to export the tensors alone."""


class ExportDependencyError(ExportError, ImportError):
    """An optional package that an export format needs is not installed."""


# -- checks ------------------------------------------------------------------------------------


def check_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
    """``formats`` as a tuple without duplicates; ``ValueError`` for an unknown or empty one."""
    if isinstance(formats, str):
        formats = (formats,)
    out: list[str] = []
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; valid formats: {', '.join(FORMATS)}")
        if fmt not in out:
            out.append(fmt)
    if not out:
        raise ValueError(f"no export format given; valid formats: {', '.join(FORMATS)}")
    if "hf" in out and "safetensors" in out:
        raise ValueError("export formats 'hf' and 'safetensors' both write model.safetensors: use one (an 'hf' "
                         "export's weights load with from_pretrained, or load_exported(dir, 'hf'))")
    return tuple(out)


def traced_formats(formats: Sequence[str]) -> list[str]:
    """The formats in ``formats`` that trace the model (and so need example inputs), in order."""
    return [fmt for fmt in formats if fmt in TRACED_FORMATS]


def missing_inputs_error(formats: Sequence[str]) -> ValueError:
    """The error for traced ``formats`` asked for without example inputs (returned, not raised)."""
    names = ", ".join(repr(f) for f in traced_formats(formats))
    return ValueError(
        f"export format(s) {names} trace the model and need example inputs: pass "
        f"example_inputs=(tensor, ...) for model(*inputs), batch dimension first with batch size "
        f">= 2 (or define Task.example_inputs())"
    )


def require_modules(modules: Sequence[str], what: str) -> None:
    """:class:`ExportDependencyError` naming those of ``modules`` (needed for ``what``) not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ExportDependencyError(f"{what} needs {' and '.join(missing)}, not installed: {_ONNX_INSTALL}")


def require_onnx() -> None:
    """:class:`ExportDependencyError` unless the ``onnx`` format's packages are installed."""
    require_modules(("onnx", "onnxscript"), "the 'onnx' export format")
