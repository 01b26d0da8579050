"""Inference export: one artefact per format in a directory, plus ``metadata.json``.

Formats (:data:`FORMATS`), each a file in the export directory:

* ``safetensors`` -- ``model.safetensors``: the (unwrapped) model's state dict; load it into a
  freshly built model.
* ``torch_export`` -- ``model.pt2``: ``torch.export.export`` with a dynamic batch dimension
  (static shapes, with a warning, when that fails), saved with ``torch.export.save``.
* ``torchscript`` -- ``model.torchscript.pt``: ``torch.jit.trace`` of the model in eval mode.
* ``onnx`` -- ``model.onnx``: the ``torch.export`` graph through ``torch.onnx.export`` (the dynamo
  exporter, at its recommended opset), checked with ``onnx.checker``. Needs ``onnx`` and
  ``onnxscript`` (``pip install 'cadence[onnx]'``; loading it back also needs ``onnxruntime``).

The traced formats need example inputs (``model(*example_inputs)``, batch dimension first, batch
size >= 2). Every export writes ``metadata.json`` last: formats and files, cadence and torch
versions, input shapes and dtypes, and the caller's metadata (step, metrics, ...).

*Signatures* (:class:`ExportSignature`, :meth:`Task.export_signatures`): several named inference
entry points exported together. :func:`export_model_signatures` writes one export as above per
signature into ``<directory>/<signature>/`` (each one loadable with :func:`load_exported`), and
``<directory>/signatures.json`` last: the signatures, the formats and the caller's metadata.

On local disks an export is written into a temp sibling directory and renamed into place, so a
half-written export never appears; on other stores (object stores, ``memory://``) it is written
locally, then uploaded with ``metadata.json`` last: an export is complete when its metadata exists.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.util
import io
import json
import logging
import os
import posixpath
import re
import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.storage import Storage
from cadence.torch.state import (
    MODEL_FILE,
    model_to_safetensors,
    state_dict_from_safetensors,
    unwrap_model,
)
from cadence.torch.task import Task

log = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("safetensors", "torch_export", "torchscript", "onnx")
"""The export formats, in the order of the module docstring."""
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
_SIGNATURE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
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


def _as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    """Example inputs as a tuple (a lone tensor is wrapped); ``None`` stays ``None``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of tensors for model(*inputs), "
        f"got {type(example_inputs).__name__}"
    )


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


# -- signatures ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ExportSignature:
    """One named inference entry point of an export (see :meth:`Task.export_signatures`).

    ``module``: an ``nn.Module``, or a plain callable of tensors (e.g. ``lambda x:
    model(x).softmax(-1)``), which is wrapped into an ``nn.Module`` at export so that every
    format works. The ``safetensors`` artefact of a signature is its module's ``state_dict()``;
    for a plain callable it is the state dict of the model it is exported with (the ``model``
    given to :func:`export_model_signatures`: the trained model, when exported from a Task), and
    empty without one.

    ``example_inputs``: a tensor or a tuple of tensors for ``module(*inputs)``, batch dimension
    first with batch size >= 2 (kept as a tuple); needed by the traced formats (``torch_export``,
    ``torchscript``, ``onnx``), ``None`` when only ``safetensors`` is exported.

    Raises ``TypeError`` when ``module`` is not callable or ``example_inputs`` is not tensors.
    """

    module: nn.Module | Callable[..., Any]
    example_inputs: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if not callable(self.module):
            got = type(self.module).__name__
            raise TypeError(f"ExportSignature.module must be an nn.Module or a callable, got {got}")
        object.__setattr__(self, "example_inputs", _as_inputs(self.example_inputs))


class _CallableModule(nn.Module):
    """A plain callable as a module; ``model`` (the module the callable uses, if given) is
    registered so that its weights are traced as parameters, put in eval mode and saved."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module | None) -> None:
        super().__init__()
        self.fn = fn
        self.model = model

    def forward(self, *inputs: Any) -> Any:
        return self.fn(*inputs)


def _signature_module(sig: ExportSignature, model: nn.Module | None) -> nn.Module:
    if isinstance(sig.module, nn.Module):
        return unwrap_model(sig.module)
    return _CallableModule(sig.module, None if model is None else unwrap_model(model))


def check_signatures(
    signatures: Mapping[str, ExportSignature], formats: str | Sequence[str]
) -> dict[str, ExportSignature]:
    """``signatures`` as a dict, checked for export in ``formats``.

    Raises ``TypeError`` for a non-mapping or a value that is not an :class:`ExportSignature`, and
    ``ValueError`` for a name that is not a safe directory name (``[A-Za-z0-9_.-]+``, not ``.``,
    ``..`` or ``signatures.json``) or a signature without example inputs when a format traces the
    model; each error names the signature.
    """
    formats = _check_formats(formats)
    if not isinstance(signatures, Mapping):
        got = type(signatures).__name__
        raise TypeError(f"export signatures must be a mapping of name to ExportSignature, got {got}")
    out: dict[str, ExportSignature] = {}
    for name, sig in signatures.items():
        if not isinstance(name, str) or not _SIGNATURE_NAME.fullmatch(name) or name in (".", "..", SIGNATURES_FILE):
            raise ValueError(
                f"export signature name {name!r} is not a safe directory name: use letters, digits, "
                f"'_', '.' and '-' (not '.', '..' or {SIGNATURES_FILE!r})"
            )
        if not isinstance(sig, ExportSignature):
            raise TypeError(f"export signature {name!r} must be an ExportSignature, got {type(sig).__name__}")
        if sig.example_inputs is None and _traced(formats):
            names = ", ".join(repr(f) for f in _traced(formats))
            raise ValueError(
                f"export signature {name!r} has no example_inputs, and export format(s) {names} trace it: "
                f"give ExportSignature(module, example_inputs=(tensor, ...)), batch dimension first "
                f"with batch size >= 2"
            )
        out[name] = sig
    return out


# -- the model to trace ------------------------------------------------------------------------


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _display_name(model: nn.Module) -> str:
    """The class name of ``model``; a wrapped plain callable's own name."""
    if isinstance(model, _CallableModule):
        return getattr(model.fn, "__name__", type(model.fn).__name__)
    return type(model).__name__


def _capture(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[torch.export.ExportedProgram, bool]:
    """``torch.export.export`` with a dynamic batch dim, else static; returns (program, dynamic)."""
    dynamic = _dynamic_batch_shapes(inputs)
    if dynamic is not None and isinstance(model, _CallableModule):
        dynamic = (dynamic,)  # forward(*inputs): one var-positional parameter
    if dynamic is not None:
        try:
            return torch.export.export(model, inputs, dynamic_shapes=dynamic), True
        except Exception as e:  # constraint violations, data-dependent shapes, ...
            log.warning(
                "torch.export with a dynamic batch dimension failed (%s); exporting with static "
                "shapes: the exported model accepts only the example inputs' shapes",
                _first_line(e),
            )
    try:
        return torch.export.export(model, inputs), False
    except Exception as e:
        raise ExportError(f"torch.export.export failed for {_display_name(model)}: {e}") from e


class _Job:
    """One export's model and inputs; the CPU eval-mode model and the ``torch.export`` program
    are made on first use and shared by the formats."""

    def __init__(self, source: nn.Module, inputs: tuple[Any, ...] | None) -> None:
        self.source = source
        self._inputs = inputs
        self.weights: nn.Module = source  # whose state dict the safetensors artefact holds
        described: Any = type(source)
        if isinstance(source, _CallableModule):
            described = source.fn
            self.weights = source.model if source.model is not None else source
        qualname = getattr(described, "__qualname__", type(described).__qualname__)
        self.model_class = f"{getattr(described, '__module__', None) or ''}.{qualname}"
        self._model: nn.Module | None = None
        self._program: torch.export.ExportedProgram | None = None
        self.dynamic_batch: bool | None = None

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
            self._program, self.dynamic_batch = _capture(self.model, self.inputs)
        return self._program


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
    return {"dynamic_batch": job.dynamic_batch}


def _write_torchscript(job: _Job, stage: str) -> dict[str, Any]:
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
    try:
        with _quiet_onnx_exporter():
            onnx_program = torch.onnx.export(program, job.inputs, verbose=False, external_data=external)
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
        "dynamic_batch": job.dynamic_batch,
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


# -- staging and publishing ---------------------------------------------------------------------


def _temp_name(path: str, kind: str = "tmp") -> str:
    return f"{path}.{kind}-{secrets.token_hex(6)}"


def _fsync_files(storage: Storage, directory: str) -> None:
    """fsync every file under ``directory`` (signature subdirectories included), then the dirs."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            _fsync_files(storage, path)
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    storage.fsync_dir(directory)


def _staged_files(local: str) -> list[str]:
    """The files under ``local`` as relative ``/`` paths, in upload order: artefacts, then each
    ``metadata.json``, then ``signatures.json`` (an export is complete once those exist)."""
    names = []
    for root, _, files in os.walk(local):
        rel = os.path.relpath(root, local)
        names += [name if rel == "." else posixpath.join(rel.replace(os.sep, "/"), name) for name in files]
    return sorted(names, key=lambda n: (n == SIGNATURES_FILE, posixpath.basename(n) == METADATA_FILE, n))


def _publish_local(storage: Storage, temp: str) -> None:
    """Rename the staged ``temp`` dir to ``storage.root``, replacing an existing export there."""
    final = storage.root
    _fsync_files(storage, temp)
    if storage.exists(final):
        old = _temp_name(final, "old")
        storage.rename(final, old)
        storage.rename(temp, final)
        storage.rmtree(old)
    else:
        storage.rename(temp, final)


def _upload(storage: Storage, local: str) -> None:
    """Copy the staged files to ``storage.root`` (replacing what is there), metadata last."""
    for marker in (SIGNATURES_FILE, METADATA_FILE):  # the old export stops looking complete first
        if storage.exists(storage.join(marker)):
            storage.remove(storage.join(marker))
    storage.rmtree(storage.root)
    storage.makedirs(storage.root)
    for name in _staged_files(local):
        if "/" in name:
            storage.makedirs(storage.join(posixpath.dirname(name)))
        with open(os.path.join(local, *name.split("/")), "rb") as src, storage.open_write(storage.join(name)) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


@contextlib.contextmanager
def _staging(storage: Storage) -> Iterator[str]:
    """A local directory to write the export into; published to ``storage.root`` on success."""
    if storage.atomic_rename:
        storage.makedirs(posixpath.dirname(storage.root))
        temp = _temp_name(storage.root)
        storage.makedirs(temp)
        try:
            yield temp
            _publish_local(storage, temp)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    else:
        with tempfile.TemporaryDirectory(prefix="cadence-export-") as temp:
            yield temp
            _upload(storage, temp)


# -- the API -----------------------------------------------------------------------------------


def export_model(
    model: nn.Module,
    directory: str,
    formats: str | Sequence[str],
    *,
    example_inputs: torch.Tensor | Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Write one inference artefact per format into ``directory``; return ``{format: path}``.

    ``directory`` (a local path or an fsspec URL) is created, or replaced when it exists; the
    export appears all at once on local disks, and is complete once ``metadata.json`` exists
    elsewhere. ``model`` may be wrapped (DDP, ``torch.compile``); it is traced in eval mode on
    CPU (a copy when it lives elsewhere), and its modes are restored afterwards. ``metadata``
    (JSON-able after tensors become numbers; keys must not clash with cadence's own) is merged
    into ``metadata.json``.

    Raises ``ValueError`` for an unknown format, or when a traced format lacks
    ``example_inputs``; :class:`ExportDependencyError` when ``onnx`` / ``onnxscript`` are
    missing; :class:`ExportError` when a format's export fails. Nothing is published on failure.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_model needs an nn.Module, got {type(model).__name__}")
    formats = _check_formats(formats)
    inputs = _as_inputs(example_inputs)
    if inputs is None and _traced(formats):
        raise _missing_inputs_error(formats)
    if "onnx" in formats:
        _require_onnx()
    extra = _caller_metadata(metadata)
    storage = Storage(directory)
    source = unwrap_model(model)
    job = _Job(source, inputs)
    with _modes_restored([source]), _staging(storage) as stage:
        _write_export(job, stage, formats, extra)
    log.info("exported %s to %s", ", ".join(formats), storage.url(storage.root))
    return {fmt: _user_path(storage, directory, FILES[fmt]) for fmt in formats}


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


def export_model_signatures(
    signatures: Mapping[str, ExportSignature],
    directory: str,
    formats: str | Sequence[str],
    *,
    model: nn.Module | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, str]]:
    """Export each signature as :func:`export_model` would into ``directory/<name>/``; return
    ``{name: {format: path}}``.

    Each ``<name>/`` holds the format files and a ``metadata.json`` (with ``"signature": name``
    and the caller's ``metadata``), and loads with :func:`load_exported`. ``signatures.json``
    beside them, written last, lists the signatures (directory, model class, inputs), the
    formats, and the caller's ``metadata`` (e.g. ``step``); :func:`read_signatures` reads it.
    ``directory`` is created or replaced as a whole, all at once on local disks. ``model``: the
    model the signatures were built from; a plain-callable signature registers it (traced as
    parameters, in eval mode, saved as its safetensors). Modules are traced in eval mode on CPU
    (plain callables must already be there) and their modes are restored afterwards.

    Raises ``TypeError`` / ``ValueError`` (naming the signature) for a bad name, a value that is
    not an :class:`ExportSignature`, missing example inputs for a traced format, or an unknown
    format, and ``ValueError`` for no signatures; :class:`ExportDependencyError` and
    :class:`ExportError` (naming the signature) as :func:`export_model`. Nothing is published on
    failure.
    """
    formats = _check_formats(formats)
    checked = check_signatures(signatures, formats)
    if not checked:
        raise ValueError("export_model_signatures: no signatures given (use export_model for one model)")
    if "onnx" in formats:
        _require_onnx()
    extra = _caller_metadata(metadata)
    storage = Storage(directory)
    modules = {name: _signature_module(sig, model) for name, sig in checked.items()}
    jobs = {name: _Job(modules[name], checked[name].example_inputs) for name in checked}
    with _modes_restored(list(modules.values())), _staging(storage) as stage:
        for name, job in jobs.items():
            os.makedirs(os.path.join(stage, name))
            try:
                _write_export(job, os.path.join(stage, name), formats, {**extra, "signature": name})
            except ExportError as e:
                raise type(e)(f"export signature {name!r}: {e}") from e
        listing = {
            "format_version": METADATA_VERSION,
            "signatures": {
                name: {
                    "directory": name,
                    "model_class": job.model_class,
                    "inputs": [_describe_input(x) for x in job._inputs] if job._inputs is not None else None,
                }
                for name, job in jobs.items()
            },
            "formats": list(formats),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **extra,
        }
        with open(os.path.join(stage, SIGNATURES_FILE), "w", encoding="utf-8") as f:
            json.dump(listing, f, indent=2)
    log.info("exported signatures %s as %s to %s", ", ".join(checked), ", ".join(formats), storage.url(storage.root))
    return {
        name: {fmt: _user_path(storage, directory, f"{name}/{FILES[fmt]}") for fmt in formats} for name in checked
    }


def has_export_signatures(task: Task) -> bool:
    """Whether ``task``'s class overrides :meth:`Task.export_signatures` (it may still return ``{}``)."""
    return type(task).export_signatures is not Task.export_signatures


def export_task_model(
    task: Task,
    model: nn.Module,
    directory: str,
    formats: str | Sequence[str],
    *,
    example_inputs: torch.Tensor | Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Export ``model`` (trained by ``task``; may be wrapped) as the task says; return the files.

    When the task overrides :meth:`Task.export_signatures`, it is called with ``m``, the
    unwrapped model in eval mode on CPU (a copy when it lives elsewhere; modes are restored
    afterwards). When it is not overridden or returns ``{}``, this is ``export_model(model,
    directory, formats, example_inputs=...)`` and returns ``{format: path}``; otherwise
    :func:`export_model_signatures` with ``model=m`` (``example_inputs`` unused), flattened to
    ``{"<signature>/<format>": path}``. Raises as those functions.
    """
    if not has_export_signatures(task):
        return export_model(model, directory, formats, example_inputs=example_inputs, metadata=metadata)
    source = unwrap_model(model)
    cpu = source if _on_cpu(source) else _cpu_copy(source)
    with _modes_restored([cpu]):
        cpu.eval()
        signatures = task.export_signatures(cpu)
        if not signatures:
            return export_model(cpu, directory, formats, example_inputs=example_inputs, metadata=metadata)
        files = export_model_signatures(signatures, directory, formats, model=cpu, metadata=metadata)
    return {f"{name}/{fmt}": path for name, paths in files.items() for fmt, path in paths.items()}


def _user_path(storage: Storage, directory: str, name: str) -> str:
    """``name`` in ``directory`` as the caller wrote it: a URL stays a URL, a local path is absolute."""
    if storage.atomic_rename:
        return storage.url(storage.join(name))
    return f"{directory.rstrip('/')}/{name}"


def read_export_metadata(directory: str) -> dict[str, Any]:
    """The ``metadata.json`` of a complete export; :class:`ExportError` when there is none."""
    storage = Storage(directory)
    try:
        return json.loads(storage.read_bytes(storage.join(METADATA_FILE)))
    except FileNotFoundError:
        pass
    if storage.exists(storage.join(SIGNATURES_FILE)):
        names = ", ".join(read_signatures(directory)["signatures"])
        raise ExportError(
            f"{storage.url(storage.root)} is an export with signatures ({names}): load one of its "
            f"signature directories, e.g. {directory.rstrip('/')}/<signature>"
        )
    raise ExportError(f"{storage.url(storage.root)} is not a complete export: no {METADATA_FILE}")


def read_signatures(directory: str) -> dict[str, Any]:
    """The ``signatures.json`` of a complete export with signatures (``{"signatures": {name:
    {"directory", "model_class", "inputs"}}, "formats": [...], "step": ..., ...}``);
    :class:`ExportError` when there is none."""
    storage = Storage(directory)
    try:
        return json.loads(storage.read_bytes(storage.join(SIGNATURES_FILE)))
    except FileNotFoundError:
        raise ExportError(
            f"{storage.url(storage.root)} is not a complete export with signatures: no {SIGNATURES_FILE}"
        ) from None


def load_exported(directory: str, format: str) -> Any:
    """Load one artefact of the export in ``directory`` (local path or fsspec URL) for inference.

    ``safetensors``: the state dict (load it into a freshly built model); ``torch_export``: the
    ``torch.export`` program's ``.module()``; ``torchscript``: the ``torch.jit`` module (on CPU);
    ``onnx``: an ``onnxruntime.InferenceSession`` on the available providers. Raises
    :class:`ExportError` when the export is incomplete or lacks the format.
    """
    (fmt,) = _check_formats((format,))
    storage = Storage(directory)
    meta = read_export_metadata(directory)
    if fmt not in meta.get("formats", {}):
        raise ExportError(
            f"{storage.url(storage.root)} has no {fmt!r} artefact (formats: {', '.join(meta.get('formats', {}))})"
        )
    path = storage.join(meta["formats"][fmt].get("file", FILES[fmt]))
    if fmt == "safetensors":
        return state_dict_from_safetensors(storage.read_bytes(path))
    if fmt == "onnx":
        return _onnx_session(storage, path, meta)
    source: Any = path if storage.atomic_rename else io.BytesIO(storage.read_bytes(path))
    if fmt == "torch_export":
        return torch.export.load(source).module()
    with _quiet_jit():
        return torch.jit.load(source, map_location="cpu")


def _onnx_session(storage: Storage, path: str, meta: Mapping[str, Any]) -> Any:
    _require_modules(("onnxruntime",), "loading an 'onnx' export")
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if storage.atomic_rename:
        return onnxruntime.InferenceSession(path, providers=providers)
    with tempfile.TemporaryDirectory(prefix="cadence-onnx-") as local:  # external data sits beside the model
        for name in meta.get("files", []):
            if name.startswith(posixpath.basename(path)):
                with open(os.path.join(local, name), "wb") as f:
                    f.write(storage.read_bytes(storage.join(name)))
        return onnxruntime.InferenceSession(os.path.join(local, posixpath.basename(path)), providers=providers)


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class ExportModel:
    """An action that exports the model on each call (e.g. as an eval action).

    Each call takes ``file_manager.next_name()`` as the directory, runs :func:`export_model`
    with ``metadata={"metrics": output, "step": controller.global_step}`` (``step`` once
    attached to a controller), then ``file_manager.clean_up()``, and returns the directory. Under
    ``torch.distributed`` only rank 0 exports (other ranks return ``None``).

    The model: ``model_fn()`` (a zero-arg callable returning the live module) when given, else
    ``task_or_model`` when it is an ``nn.Module``, else the attached controller's
    ``trainer.model`` / ``evaluator.model``. Example inputs: ``example_inputs``, else the task's
    :meth:`Task.example_inputs` (called once, on the first export). A task with
    :meth:`Task.export_signatures` is exported through :func:`export_task_model` (one directory
    per signature; each signature brings its own example inputs, checked at each export).

    Raises ``ValueError`` at construction for unknown formats, or traced formats with no way to
    get example inputs.
    """

    def __init__(
        self,
        task_or_model: Task | nn.Module,
        file_manager: Any,
        formats: str | Sequence[str] = ("safetensors",),
        *,
        example_inputs: torch.Tensor | Sequence[Any] | None = None,
        model_fn: Callable[[], nn.Module] | None = None,
    ) -> None:
        if not isinstance(task_or_model, (Task, nn.Module)):
            raise TypeError(f"ExportModel needs a Task or an nn.Module, got {type(task_or_model).__name__}")
        self.formats = _check_formats(formats)
        self.file_manager = file_manager
        self._task = task_or_model if isinstance(task_or_model, Task) else None
        self._module = task_or_model if isinstance(task_or_model, nn.Module) else None
        self._model_fn = model_fn
        self._example_inputs = _as_inputs(example_inputs)
        self._inputs_resolved = self._example_inputs is not None
        self._controller: Any = None
        if self._example_inputs is None and _traced(self.formats):
            task_defines = self._task is not None and (
                type(self._task).example_inputs is not Task.example_inputs or has_export_signatures(self._task)
            )
            if not task_defines:
                raise _missing_inputs_error(self.formats)
        if "onnx" in self.formats:
            _require_onnx()

    def attach(self, controller: Any) -> None:
        """Called by the controller: its ``global_step`` goes into the metadata as ``step``."""
        self._controller = controller

    def _model(self) -> nn.Module:
        if self._model_fn is not None:
            return self._model_fn()
        if self._module is not None:
            return self._module
        for runner in (getattr(self._controller, "trainer", None), getattr(self._controller, "evaluator", None)):
            model = getattr(runner, "model", None)
            if isinstance(model, nn.Module):
                return model
        raise ExportError(
            "ExportModel cannot find the model: pass model_fn= (a zero-arg callable returning the "
            "live model), or attach it to a controller whose trainer or evaluator has a .model"
        )

    def _inputs(self) -> tuple[Any, ...] | None:
        if not self._inputs_resolved and self._task is not None:
            self._inputs_resolved = True
            try:
                self._example_inputs = _as_inputs(self._task.example_inputs())
            except NotImplementedError:
                if _traced(self.formats) and not has_export_signatures(self._task):
                    raise  # with signatures, export_task_model checks each one's inputs
        return self._example_inputs

    def __call__(self, output: Mapping[str, Any]) -> str | None:
        if not _is_rank_zero():
            return None
        directory = self.file_manager.next_name()
        metadata: dict[str, Any] = {"metrics": dict(output or {})}
        if self._controller is not None:
            metadata["step"] = int(self._controller.global_step)
        if self._task is not None:
            export_task_model(self._task, self._model(), directory, self.formats, example_inputs=self._inputs(),
                              metadata=metadata)
        else:
            export_model(self._model(), directory, self.formats, example_inputs=self._inputs(), metadata=metadata)
        self.file_manager.clean_up()
        return directory

    def __repr__(self) -> str:
        return f"ExportModel(formats={list(self.formats)}, file_manager={self.file_manager!r})"
