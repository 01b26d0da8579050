"""How one model becomes inference artefacts: one file per format in a local directory, plus ``metadata.json``.

Formats (:data:`FORMATS`), each a file in the export directory:

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

The traced formats need example inputs (``model(*example_inputs)``, batch dimension first, batch
size >= 2). Every export writes ``metadata.json`` last: formats and files, cadence and torch
versions, input shapes and dtypes, and the caller's metadata (step, metrics, ...).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.util
import json
import logging
import os
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from cadence.config.schema import EXPORT_FORMATS
from cadence.errors import CadenceError, one_line
from cadence.torch.checkpoint_io.state import MODEL_FILE, model_to_safetensors
from cadence.torch.task.export_specs import ExportSpec, dim_bounds

log = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = EXPORT_FORMATS
"""The export formats (the config schema's list), in the order of the module docstring."""
TRACED_FORMATS = frozenset({"torch_export", "torchscript", "onnx"})
"""Formats that run the model on example inputs."""
FILES: dict[str, str] = {
    "safetensors": MODEL_FILE,
    "torch_export": "model.pt2",
    "torchscript": "model.torchscript.pt",
    "onnx": "model.onnx",
}
"""The artefact file of each format."""
METADATA_FILE = "metadata.json"
METADATA_VERSION = 1
SIGNATURES_FILE = "signatures.json"
"""Beside the signature directories of an export with signatures; written last."""
_ONNX_EXTERNAL_DATA_BYTES = 1 << 30  # larger weights go to model.onnx.data (protobuf's 2 GiB limit)
_RESERVED_KEYS = frozenset(
    {"format_version", "formats", "files", "model_class", "inputs", "cadence_version", "torch_version", "created_at",
     "signature", "signatures"}
)
_ONNX_INSTALL = "pip install 'cadence[onnx]'"


class ExportError(CadenceError):
    """An export could not be written, or an exported artefact could not be read back."""


class ExportDependencyError(ExportError, ImportError):
    """An optional package that an export format needs is not installed."""


# -- checks ------------------------------------------------------------------------------------


def _check_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
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
    return tuple(out)


def _traced(formats: Sequence[str]) -> list[str]:
    return [fmt for fmt in formats if fmt in TRACED_FORMATS]


def _missing_inputs_error(formats: Sequence[str]) -> ValueError:
    names = ", ".join(repr(f) for f in _traced(formats))
    return ValueError(
        f"export format(s) {names} trace the model and need example inputs: pass "
        f"example_inputs=(tensor, ...) for model(*inputs), batch dimension first with batch size "
        f">= 2 (or define Task.example_inputs())"
    )


def _require_modules(modules: Sequence[str], what: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ExportDependencyError(f"{what} needs {' and '.join(missing)}, not installed: {_ONNX_INSTALL}")


def _require_onnx() -> None:
    _require_modules(("onnx", "onnxscript"), "the 'onnx' export format")


# -- the model to trace ------------------------------------------------------------------------


class _CallableModule(nn.Module):
    """A plain callable as a module; ``model`` (the module the callable uses, if given) is
    registered so that its weights are traced as parameters, put in eval mode and saved."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module | None) -> None:
        super().__init__()
        self.fn = fn
        self.model = model

    def forward(self, *inputs: Any) -> Any:
        return self.fn(*inputs)


def _on_cpu(model: nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on CPU; parameters and buffers are copied straight to CPU (never
    duplicated on their own device)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo).to("cpu")


def _cpu_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.detach().to("cpu") if isinstance(x, torch.Tensor) else x for x in inputs)


def _dynamic_batch_shapes(inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``dynamic_shapes`` with one shared batch dim (dim 0 of every tensor input), or ``None``
    (with a warning) when the inputs cannot give one."""
    sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1 or min(sizes) < 2:
        log.warning(
            "example inputs have batch sizes %s: need one batch size >= 2 for a dynamic batch "
            "dimension; exporting with static shapes",
            sorted(sizes),
        )
        return None
    batch = torch.export.Dim("batch")
    return tuple({0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs)


def dynamic_shapes_of(spec: ExportSpec, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``torch.export``'s ``dynamic_shapes`` for ``inputs`` (one entry per input) as ``spec``
    declares them; ``None``: no dynamic dimension. The default spec gives the shared batch dim
    (``None``, with a warning, when the inputs cannot have one).

    Raises ``ValueError`` (naming the input and dim) for a declaration that does not fit the
    example inputs: another number of entries than inputs, a dim the input does not have, an
    example size outside the declared bounds or below 2 (``torch.export`` takes sizes 0 and 1
    for constants), or one name with two different bounds.
    """
    if spec.dynamic_dims is None:
        return _dynamic_batch_shapes(inputs)
    declared = spec.dynamic_dims
    if len(declared) != len(inputs):
        raise ValueError(f"ExportSpec.dynamic_dims has {len(declared)} entries for {len(inputs)} example inputs: "
                         f"give one per input (None for an input of fixed shape)")
    dims: dict[str, Any] = {}
    bounds: dict[str, tuple[int | None, int | None]] = {}
    shapes: list[Any] = []
    for i, (x, entry) in enumerate(zip(inputs, declared)):
        if not entry:
            shapes.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"ExportSpec.dynamic_dims[{i}]: example input {i} is a {type(x).__name__}, not a tensor")
        shape: dict[int, Any] = {}
        for d, dim in entry.items():
            where = f"ExportSpec.dynamic_dims[{i}][{d}]"
            index = d + x.dim() if d < 0 else d
            if not 0 <= index < x.dim():
                raise ValueError(f"{where}: example input {i} has {x.dim()} dims (shape {list(x.shape)})")
            size = int(x.shape[index])
            parsed = dim_bounds(dim, where)
            if parsed is None:  # a torch.export.Dim of the caller's
                name = dim.__name__
                lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
                dims.setdefault(name, dim)
            else:
                name, lo, hi = parsed
                if name in bounds and bounds[name] != (lo, hi):
                    raise ValueError(f"{where}: dimension {name!r} is declared with bounds {bounds[name]} and "
                                     f"{(lo, hi)}")
                if name not in dims:
                    dims[name] = torch.export.Dim(name, **{k: v for k, v in (("min", lo), ("max", hi)) if v is not None})
            bounds.setdefault(name, (lo, hi))
            if size < 2:
                raise ValueError(f"{where}: dimension {name!r} has size {size} in example input {i}; torch.export "
                                 f"takes sizes 0 and 1 for constants: give an example of size >= 2")
            if (lo is not None and size < lo) or (hi is not None and size > hi):
                raise ValueError(f"{where}: example input {i} has size {size} there, outside {name!r}'s bounds "
                                 f"[{lo}, {hi}]")
            shape[index] = dims[name]
        shapes.append(shape)
    if spec.input_names is not None:
        tensors = sum(isinstance(x, torch.Tensor) for x in inputs)
        if len(spec.input_names) != tensors:
            raise ValueError(f"ExportSpec.input_names names {len(spec.input_names)} inputs, the example inputs "
                             f"hold {tensors} tensors")
    return tuple(shapes) if any(s for s in shapes) else None


def check_spec(spec: ExportSpec, inputs: tuple[Any, ...]) -> None:
    """``ValueError`` when ``spec`` does not fit ``inputs`` (see :func:`dynamic_shapes_of`); the default
    spec always does (it falls back to static shapes)."""
    if spec.declares_dims or spec.input_names is not None:
        dynamic_shapes_of(spec if spec.declares_dims else ExportSpec(dynamic_dims=[None] * len(inputs),
                                                                     input_names=spec.input_names), inputs)


def describe_dynamic_dims(shapes: tuple[Any, ...] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """``dynamic_shapes`` as JSON for ``metadata.json``: per input ``{dim: {name, min, max}}``."""
    if shapes is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for shape in shapes:
        if not shape:
            out.append(None)
            continue
        described = {}
        for d, dim in shape.items():
            lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
            described[str(d)] = {"name": dim.__name__, "min": lo if isinstance(lo, int) else None,
                                 "max": hi if isinstance(hi, int) and hi < 2**62 else None}
        out.append(described)
    return out


def _display_name(model: nn.Module) -> str:
    """The class name of ``model``; a wrapped plain callable's own name."""
    if isinstance(model, _CallableModule):
        return getattr(model.fn, "__name__", type(model.fn).__name__)
    return type(model).__name__


def _capture(model: nn.Module, inputs: tuple[Any, ...], spec: ExportSpec) -> tuple[torch.export.ExportedProgram, Any]:
    """``torch.export.export`` with the spec's dynamic dims; returns (program, dynamic_shapes used or
    None). The default spec falls back to static shapes (with a warning); declared dims raise."""
    try:
        dynamic = dynamic_shapes_of(spec, inputs)
    except ValueError as e:
        raise ExportError(f"{_display_name(model)}: {e}") from e
    if dynamic is not None and isinstance(model, _CallableModule):
        dynamic = (dynamic,)  # forward(*inputs): one var-positional parameter
    if dynamic is not None:
        try:
            return torch.export.export(model, inputs, dynamic_shapes=dynamic), dynamic
        except Exception as e:  # constraint violations, data-dependent shapes, ...
            if spec.declares_dims:
                raise ExportError(
                    f"torch.export.export failed for {_display_name(model)} with the declared dynamic dimensions "
                    f"{describe_dynamic_dims(dynamic if not isinstance(model, _CallableModule) else dynamic[0])}: "
                    f"{one_line(e)} (a dimension the model computes with as a constant must stay static)"
                ) from e
            log.warning(
                "torch.export with a dynamic batch dimension failed (%s); exporting with static "
                "shapes: the exported model accepts only the example inputs' shapes",
                one_line(e),
            )
    try:
        return torch.export.export(model, inputs), None
    except Exception as e:
        raise ExportError(f"torch.export.export failed for {_display_name(model)}: {e}") from e


class _Job:
    """One export's model and inputs; the CPU eval-mode model and the ``torch.export`` program
    are made on first use and shared by the formats."""

    def __init__(self, source: nn.Module, inputs: tuple[Any, ...] | None, spec: ExportSpec | None = None) -> None:
        self.source = source
        self._inputs = inputs
        self.spec = spec if spec is not None else ExportSpec()
        self.weights: nn.Module = source  # whose state dict the safetensors artefact holds
        described: Any = type(source)
        if isinstance(source, _CallableModule):
            described = source.fn
            self.weights = source.model if source.model is not None else source
        qualname = getattr(described, "__qualname__", type(described).__qualname__)
        self.model_class = f"{getattr(described, '__module__', None) or ''}.{qualname}"
        self._model: nn.Module | None = None
        self._program: torch.export.ExportedProgram | None = None
        self.dynamic_shapes: Any = None  # as given to torch.export (None: static)

    @property
    def model(self) -> nn.Module:
        """The model in eval mode on CPU (``source`` itself when already there, else a copy)."""
        if self._model is None:
            if not _on_cpu(self.source) and isinstance(self.source, _CallableModule):
                raise ExportError(
                    "a plain-callable export signature is traced on CPU and cannot be copied there: "
                    "build it on a CPU model (Task.export_signatures gets one when exported by cadence)"
                )
            self._model = self.source if _on_cpu(self.source) else _cpu_copy(self.source)
            self._model.eval()
        return self._model

    @property
    def inputs(self) -> tuple[Any, ...]:
        assert self._inputs is not None, "checked by export_model"
        return _cpu_inputs(self._inputs)

    def program(self) -> torch.export.ExportedProgram:
        if self._program is None:
            self._program, self.dynamic_shapes = _capture(self.model, self.inputs, self.spec)
        return self._program

    def dynamic_info(self) -> dict[str, Any]:
        """The metadata of the program's dynamic dims: ``dynamic_batch`` (dim 0 of every tensor input
        is dynamic) and ``dynamic_dims`` (per input ``{dim: {name, min, max}}``, or null)."""
        shapes = self.dynamic_shapes
        if shapes is not None and isinstance(self.model, _CallableModule):
            shapes = shapes[0]
        per_input = describe_dynamic_dims(shapes)
        tensors = [i for i, x in enumerate(self._inputs or ()) if isinstance(x, torch.Tensor) and x.dim() > 0]
        batch = per_input is not None and bool(tensors) and all(
            per_input[i] is not None and "0" in per_input[i] for i in tensors)  # type: ignore[operator]
        return {"dynamic_batch": batch, "dynamic_dims": per_input}


@contextlib.contextmanager
def _quiet_jit() -> Iterator[None]:
    """Silence torch.jit's own deprecation warnings (``torch.jit.trace`` / ``save`` / ``load``), only those."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        yield


class _DropTorchvisionNotice(logging.Filter):
    """Drops torch.onnx's "torchvision is not installed. Skipping torchvision::nms" (one per op, per export)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torchvision is not installed")


@contextlib.contextmanager
def _quiet_onnx_exporter() -> Iterator[None]:
    """Silence two notices of torch's own making that a user cannot act on, only those: the
    missing-torchvision log lines, and torch's internal ``LeafSpec`` deprecation warning."""
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    notice = _DropTorchvisionNotice()
    registry_log.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
            yield
    finally:
        registry_log.removeFilter(notice)


# -- writers: (job, local staging dir) -> extra metadata of the format --------------------------


def _write_safetensors(job: _Job, stage: str) -> dict[str, Any]:
    with open(os.path.join(stage, FILES["safetensors"]), "wb") as f:
        f.write(model_to_safetensors(job.weights))
    return {}


def _write_torch_export(job: _Job, stage: str) -> dict[str, Any]:
    torch.export.save(job.program(), os.path.join(stage, FILES["torch_export"]))
    return job.dynamic_info()


def _write_torchscript(job: _Job, stage: str) -> dict[str, Any]:
    if job.spec.declares_dims:
        log.info("torchscript: a trace cannot declare dynamic dimensions (it records the shapes the model computes "
                 "with); export torch_export or onnx for the declared ones")
    try:
        with _quiet_jit(), torch.no_grad():
            traced = torch.jit.trace(job.model, job.inputs, strict=False)
            torch.jit.save(traced, os.path.join(stage, FILES["torchscript"]))
    except Exception as e:
        raise ExportError(f"torch.jit.trace failed for {_display_name(job.model)}: {e}") from e
    return {}


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _write_onnx(job: _Job, stage: str) -> dict[str, Any]:
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
        raise ExportError(f"torch.onnx.export failed for {_display_name(job.model)}: {e}") from e
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


_WRITERS: dict[str, Callable[[_Job, str], dict[str, Any]]] = {
    "safetensors": _write_safetensors,
    "torch_export": _write_torch_export,
    "torchscript": _write_torchscript,
    "onnx": _write_onnx,
}


# -- metadata ----------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """``obj`` made of JSON types: tensors / arrays to numbers or lists, unknown objects to str."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    return str(obj)


def _caller_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    extra = _jsonable(dict(metadata or {}))
    clash = sorted(_RESERVED_KEYS.intersection(extra))
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by cadence's metadata.json")
    return extra


def _describe_input(x: Any) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
    return {"type": type(x).__name__}


def _metadata(job: _Job, infos: dict[str, dict[str, Any]], files: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    import cadence

    inputs = job._inputs
    return {
        "format_version": METADATA_VERSION,
        "formats": infos,
        "files": files,
        "model_class": job.model_class,
        "inputs": [_describe_input(x) for x in inputs] if inputs is not None else None,
        "cadence_version": cadence.__version__,
        "torch_version": torch.__version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


# -- one export into a local directory ---------------------------------------------------------


@contextlib.contextmanager
def _modes_restored(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Restore the train / eval mode of every module under ``modules`` afterwards."""
    modes = {id(m): (m, m.training) for root in modules for m in root.modules()}
    try:
        yield
    finally:
        for m, training in modes.values():
            m.training = training


def _write_export(job: _Job, stage: str, formats: Sequence[str], extra: dict[str, Any]) -> None:
    """Write each format's artefact, then ``metadata.json``, into the local dir ``stage``."""
    infos: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        start = time.perf_counter()
        infos[fmt] = {"file": FILES[fmt], **_WRITERS[fmt](job, stage)}
        log.debug("exported %s in %.2f s", fmt, time.perf_counter() - start)
    files = sorted(os.listdir(stage)) + [METADATA_FILE]
    meta = _metadata(job, infos, files, extra)
    with open(os.path.join(stage, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
