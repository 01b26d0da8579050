"""The writers of the export formats: (job, local staging dir) -> the format's extra metadata
(:data:`WRITERS`), and one export's artefacts plus ``metadata.json`` (:func:`write_export`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from cadence.torch.checkpoint_io.state import model_to_safetensors
from cadence.torch.export.capture import ExportJob, display_name
from cadence.torch.export.formats import FILES, ExportError, ExportOutputError
from cadence.torch.export.metadata import METADATA_FILE, export_metadata
from cadence.torch.hf.save import write_hf

log = logging.getLogger(__name__)

__all__ = ["WRITERS", "quiet_jit", "write_export"]

_ONNX_EXTERNAL_DATA_BYTES = 1 << 30  # larger weights go to model.onnx.data (protobuf's 2 GiB limit)


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch.jit's own deprecation warnings (``torch.jit.trace`` / ``save`` / ``load``), only those."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        yield


class _DropTorchvisionNotice(logging.Filter):
    """Drops torch.onnx's "torchvision is not installed. Skipping torchvision::nms" (one per op, per export)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torchvision is not installed")


class _DropNoneOutputNotice(logging.Filter):
    """Drops torch.onnx's two warnings that a ``None`` output (``(logits, None)``) is left out of the
    graph: ONNX has no ``None``, and cadence compares and loads the tensors alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args
        if msg.startswith("Output node %s has None output"):
            return False
        return not (msg.startswith("Skipping constant argument") and isinstance(args, tuple) and args
                    and getattr(args[0], "value", 0) is None)


@contextlib.contextmanager
def _quiet_onnx_exporter() -> Iterator[None]:
    """Silence notices of torch's own making that a user cannot act on, only those: the
    missing-torchvision log lines, the notices that a ``None`` output is left out, and torch's internal
    ``LeafSpec`` deprecation warning."""
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    core_log = logging.getLogger("torch.onnx._internal.exporter._core")
    notice, none_notice = _DropTorchvisionNotice(), _DropNoneOutputNotice()
    registry_log.addFilter(notice)
    core_log.addFilter(none_notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
            yield
    finally:
        registry_log.removeFilter(notice)
        core_log.removeFilter(none_notice)


def _write_safetensors(job: ExportJob, stage: str) -> dict[str, Any]:
    with open(os.path.join(stage, FILES["safetensors"]), "wb") as f:
        f.write(model_to_safetensors(job.weights))
    return {}


def _write_torch_export(job: ExportJob, stage: str) -> dict[str, Any]:
    torch.export.save(job.program(), os.path.join(stage, FILES["torch_export"]))
    return job.dynamic_info()


def _write_torchscript(job: ExportJob, stage: str) -> dict[str, Any]:
    if job.spec.declares_dims:
        log.info("torchscript: a trace cannot declare dynamic dimensions (it records the shapes the model computes "
                 "with); export torch_export or onnx for the declared ones")
    try:
        with quiet_jit(), torch.no_grad():
            traced = torch.jit.trace(job.model, job.inputs, strict=False)
            torch.jit.save(traced, os.path.join(stage, FILES["torchscript"]))
    except Exception as e:
        where = _none_output(job)
        if where is not None:
            raise ExportOutputError(
                f"torchscript: {display_name(job.model)}'s forward returns None at {where}, which torch.jit.trace "
                "refuses; export the tensors alone from Task.export_signatures (e.g. "
                "ExportSignature(lambda x: model(x)[0], example_inputs)) or drop torchscript from export.formats"
            ) from None
        raise ExportError(f"torch.jit.trace failed for {display_name(job.model)}: {e}") from e
    return {}


def _none_output(job: ExportJob) -> str | None:
    """Where the model's output on the example inputs holds a ``None`` (``output[1]``), or None."""
    with torch.no_grad():
        todo: list[tuple[str, Any]] = [("output", job.model(*job.inputs))]
    while todo:
        path, out = todo.pop(0)
        if out is None:
            return path
        if isinstance(out, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in out.items()]
        elif isinstance(out, (tuple, list)):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(out)]
    return None


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _write_onnx(job: ExportJob, stage: str) -> dict[str, Any]:
    import onnx

    program = job.program()
    external = _state_bytes(job.model) > _ONNX_EXTERNAL_DATA_BYTES
    names: dict[str, Any] = {}
    if job.spec.input_names is not None:
        names["input_names"] = list(job.spec.input_names)
    if job.spec.output_names is not None:
        names["output_names"] = list(job.spec.output_names)
    if job.dynamic_shapes is not None:  # ONNX names the dynamic dimensions after the declared ones
        names["dynamic_shapes"] = job.dynamic_shapes
    try:
        with _quiet_onnx_exporter():
            onnx_program = torch.onnx.export(program, job.inputs, verbose=False, external_data=external, **names)
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed for {display_name(job.model)}: {e}") from e
    if onnx_program is None:  # pragma: no cover - only the legacy exporter returns None
        raise ExportError("torch.onnx.export returned no ONNX program")
    path = os.path.join(stage, FILES["onnx"])
    onnx_program.save(path, external_data=external)
    try:
        onnx.checker.check_model(path)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the exported ONNX model failed onnx.checker: {e}") from e
    graph = onnx_program.model.graph
    return {
        **job.dynamic_info(),
        "opset": int(onnx_program.model.opset_imports.get("", 0)) or None,
        "input_names": [v.name for v in graph.inputs],
        "output_names": [v.name for v in graph.outputs],
    }


def _write_hf(job: ExportJob, stage: str) -> dict[str, Any]:
    return write_hf(job.model, stage, job.tokenizer)


WRITERS: dict[str, Callable[[ExportJob, str], dict[str, Any]]] = {
    "safetensors": _write_safetensors,
    "torch_export": _write_torch_export,
    "torchscript": _write_torchscript,
    "onnx": _write_onnx,
    "hf": _write_hf,
}


def write_export(job: ExportJob, stage: str, formats: Sequence[str], extra: dict[str, Any]) -> None:
    """Write each format's artefact, then ``metadata.json``, into the local dir ``stage``."""
    infos: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        start = time.perf_counter()
        infos[fmt] = {"file": FILES[fmt], **WRITERS[fmt](job, stage)}
        log.debug("exported %s in %.2f s", fmt, time.perf_counter() - start)
    files = sorted(os.listdir(stage)) + [METADATA_FILE]
    meta = export_metadata(job, infos, files, extra)
    with open(os.path.join(stage, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
