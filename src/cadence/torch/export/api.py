"""Inference export: the API (:func:`export_model`, :func:`load_exported`, the :class:`ExportModel`
action) over one artefact per format in a directory, plus ``metadata.json``.

The pieces live beside this module:

* :mod:`cadence.torch.export.formats` -- the formats (:data:`FORMATS`), their checks and errors;
* :mod:`cadence.torch.export.capture` and :mod:`cadence.torch.export.dynamic_shapes` -- the model
  a format traces (on CPU, in eval mode), its ``torch.export`` program and dynamic dimensions;
* :mod:`cadence.torch.export.writers` and :mod:`cadence.torch.export.metadata` -- how one model
  becomes the formats' artefacts and ``metadata.json``;
* :mod:`cadence.torch.export.staging` -- staging and publishing an export directory (atomically
  on local disks, metadata last elsewhere);
* :mod:`cadence.torch.export.signatures` -- *signatures* (:class:`ExportSignature`,
  :meth:`Task.export_signatures`): several named inference entry points exported together, one
  export per signature in ``<directory>/<signature>/`` plus ``<directory>/signatures.json``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import tempfile
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from cadence.extensions import RunContext
from cadence.storage import Storage
from cadence.torch.components.compile import eager_forward
from cadence.torch.export.capture import ExportJob, cpu_copy, modes_restored, on_cpu
from cadence.torch.export.formats import (
    FILES,
    ExportError,
    check_formats,
    missing_inputs_error,
    require_modules,
    require_onnx,
    traced_formats,
)
from cadence.torch.export.metadata import METADATA_FILE, SIGNATURES_FILE, caller_metadata
from cadence.torch.export.signatures import export_model_signatures, has_export_signatures, read_signatures
from cadence.torch.export.staging import stage_and_publish, user_path
from cadence.torch.export.writers import quiet_jit, write_export
from cadence.torch.hf.save import load_hf_export
from cadence.torch.task.export_specs import ExportSpec, SavesPretrained, as_inputs
from cadence.torch.checkpoint_io.state import state_dict_from_safetensors, unwrap_model
from cadence.torch.task.task import Task

log = logging.getLogger(__name__)


# -- the API -----------------------------------------------------------------------------------


def export_model(
    model: nn.Module,
    directory: str,
    formats: str | Sequence[str],
    *,
    example_inputs: torch.Tensor | Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    spec: ExportSpec | None = None,
    tokenizer: SavesPretrained | None = None,
) -> dict[str, str]:
    """Write one inference artefact per format into ``directory``; return ``{format: path}``.

    ``directory`` (a local path or an fsspec URL) is created; an empty directory or an earlier
    cadence export there is replaced, anything else refused (:mod:`cadence.export_marker`:
    ``.cadence-export.json`` lists the files of each export). The export appears all at once on
    local disks, and is complete once ``metadata.json`` exists elsewhere. ``model`` may be wrapped
    (DDP, ``torch.compile``); it is traced in eval mode on CPU (a copy when it lives elsewhere),
    and its modes are restored afterwards; forwards compiled
    in place (``trainer.compile``) are set aside: the module's own forward is traced. ``metadata``
    (JSON-able after tensors become numbers; keys must not clash with cadence's own) is merged
    into ``metadata.json``. ``spec``: the dynamic dimensions and ONNX input / output names
    (:class:`ExportSpec`; default: a dynamic batch dimension). ``tokenizer``: saved beside the
    model by the ``hf`` format (``tokenizer.save_pretrained``; see :meth:`Task.export_tokenizer`).

    Raises :class:`~cadence.export_marker.ExportTargetError` (a ConfigError) when ``directory`` is a
    file, a link or a directory holding anything cadence did not write, checked before anything is
    traced and again at publishing (nothing is then deleted); ``ValueError`` for an unknown format,
    or when a traced format lacks ``example_inputs``; :class:`ExportDependencyError` when ``onnx`` / ``onnxscript`` are
    missing; :class:`ExportError` when a format's export fails (also for declared dynamic
    dimensions that do not fit the inputs or the model). Nothing is published on failure.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_model needs an nn.Module, got {type(model).__name__}")
    formats = check_formats(formats)
    inputs = as_inputs(example_inputs)
    if inputs is None and traced_formats(formats):
        raise missing_inputs_error(formats)
    if "onnx" in formats:
        require_onnx()
    extra = caller_metadata(metadata)
    storage = Storage(directory)
    source = unwrap_model(model)
    job = ExportJob(source, inputs, spec, tokenizer)
    # A forward compiled by trainer.compile is set aside: the formats trace (and copy) the module's own.
    with eager_forward(source), modes_restored([source]), stage_and_publish(storage) as stage:
        write_export(job, stage, formats, extra)
    log.info("exported %s to %s", ", ".join(formats), storage.url(storage.root))
    return {fmt: user_path(storage, directory, FILES[fmt]) for fmt in formats}


def export_task_model(
    task: Task,
    model: nn.Module,
    directory: str,
    formats: str | Sequence[str],
    *,
    example_inputs: torch.Tensor | Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    spec: ExportSpec | None = None,
) -> dict[str, str]:
    """Export ``model`` (trained by ``task``; may be wrapped) as the task says; return the files.

    When the task overrides :meth:`Task.export_signatures`, it is called with ``m``, the
    unwrapped model in eval mode on CPU (a copy when it lives elsewhere; modes are restored
    afterwards). When it is not overridden or returns ``{}``, this is ``export_model(model,
    directory, formats, example_inputs=...)`` and returns ``{format: path}``; otherwise
    :func:`export_model_signatures` with ``model=m`` (``example_inputs`` unused), flattened to
    ``{"<signature>/<format>": path}``. ``example_inputs``: default :meth:`Task.example_inputs`
    (when defined); ``spec``: default :meth:`Task.export_spec` (signatures bring their own
    inputs and specs). Raises as those functions.
    """
    if spec is None:
        spec = task.export_spec()
    if example_inputs is None and traced_formats(check_formats(formats)) and not has_export_signatures(task):
        try:
            example_inputs = task.example_inputs()
        except NotImplementedError:
            pass  # export_model says what is missing
    if not has_export_signatures(task):
        return export_model(model, directory, formats, example_inputs=example_inputs, metadata=metadata, spec=spec,
                            tokenizer=task.export_tokenizer())
    source = unwrap_model(model)
    with eager_forward(source):  # trainer.compile's forwards set aside: copied and traced eagerly
        return _export_signatures(task, source, directory, formats, example_inputs, metadata, spec)


def _export_signatures(task: Task, source: nn.Module, directory: str, formats: str | Sequence[str],
                       example_inputs: Any, metadata: Mapping[str, Any] | None, spec: ExportSpec) -> dict[str, str]:
    cpu = source if on_cpu(source) else cpu_copy(source)
    with modes_restored([cpu]):
        cpu.eval()
        signatures = task.export_signatures(cpu)
        if not signatures:
            return export_model(cpu, directory, formats, example_inputs=example_inputs, metadata=metadata,
                                spec=spec)
        files = export_model_signatures(signatures, directory, formats, model=cpu, metadata=metadata)
    return {f"{name}/{fmt}": path for name, paths in files.items() for fmt, path in paths.items()}


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


def load_exported(directory: str, format: str) -> Any:
    """Load one artefact of the export in ``directory`` (local path or fsspec URL) for inference.

    ``safetensors``: the state dict (load it into a freshly built model); ``torch_export``: the
    ``torch.export`` program's ``.module()``; ``torchscript``: the ``torch.jit`` module (on CPU);
    ``onnx``: an ``onnxruntime.InferenceSession`` on the available providers; ``hf``: the
    ``transformers`` model, by ``from_pretrained`` of its class (a local export only). Raises
    :class:`ExportError` when the export is incomplete or lacks the format.
    """
    (fmt,) = check_formats((format,))
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
    if fmt == "hf":
        if not storage.atomic_rename:
            raise ExportError(f"load_exported(..., 'hf') reads a local export; copy {storage.url(storage.root)} first")
        return load_hf_export(storage.root)
    source: Any = path if storage.atomic_rename else io.BytesIO(storage.read_bytes(path))
    if fmt == "torch_export":
        return torch.export.load(source).module()
    with quiet_jit():
        return torch.jit.load(source, map_location="cpu")


def _onnx_session(storage: Storage, path: str, meta: Mapping[str, Any]) -> Any:
    require_modules(("onnxruntime",), "loading an 'onnx' export")
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



@runtime_checkable
class HoldsModel(Protocol):
    """A runner whose live model :class:`ExportModel` exports (``TorchTrainer``, ``TorchEvaluator``)."""

    model: Any

class ExportModel:
    """An action that exports the model on each call (e.g. as an eval action).

    Each call takes ``file_manager.next_name()`` as the directory, runs :func:`export_model`
    with ``metadata={"metrics": output, "step": controller.global_step}`` (``step`` once
    attached to a controller), then ``file_manager.clean_up()``, and returns the directory. Under
    ``torch.distributed`` only rank 0 exports (other ranks return ``None``). A directory holding what
    cadence did not write is refused (:class:`~cadence.export_marker.ExportTargetError`); give an
    ``ExportFileManager(..., exports_only=True)`` so that clean-up deletes only cadence's exports too.

    The model: ``model_fn()`` (a zero-arg callable returning the live module) when given, else
    ``task_or_model`` when it is an ``nn.Module``, else the attached controller's
    ``trainer.model`` / ``evaluator.model``. Example inputs: ``example_inputs``, else the task's
    :meth:`Task.example_inputs` (called once, on the first export). Dynamic dimensions and ONNX
    names: ``spec``, else the task's :meth:`Task.export_spec`, else the default :class:`ExportSpec`.
    A task with :meth:`Task.export_signatures` is exported through :func:`export_task_model` (one
    directory per signature; each signature brings its own example inputs, checked at each export).

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
        spec: ExportSpec | None = None,
    ) -> None:
        if not isinstance(task_or_model, (Task, nn.Module)):
            raise TypeError(f"ExportModel needs a Task or an nn.Module, got {type(task_or_model).__name__}")
        self.formats = check_formats(formats)
        self.file_manager = file_manager
        self._task = task_or_model if isinstance(task_or_model, Task) else None
        self._module = task_or_model if isinstance(task_or_model, nn.Module) else None
        self._model_fn = model_fn
        self._spec = spec
        self._example_inputs = as_inputs(example_inputs)
        self._inputs_resolved = self._example_inputs is not None
        self._run: RunContext | None = None
        if self._example_inputs is None and traced_formats(self.formats):
            task_defines = self._task is not None and (
                type(self._task).example_inputs is not Task.example_inputs or has_export_signatures(self._task)
            )
            if not task_defines:
                raise missing_inputs_error(self.formats)
        if "onnx" in self.formats:
            require_onnx()

    def attach(self, run: RunContext) -> None:
        """Called by the controller: the run's ``global_step`` goes into the metadata as ``step``,
        and its trainer's (or evaluator's) ``model`` is exported when no model was given."""
        self._run = run

    def _model(self) -> nn.Module:
        if self._model_fn is not None:
            return self._model_fn()
        if self._module is not None:
            return self._module
        runners = (self._run.trainer, self._run.evaluator) if self._run is not None else ()
        for runner in runners:
            if isinstance(runner, HoldsModel) and isinstance(runner.model, nn.Module):
                return runner.model
        raise ExportError(
            "ExportModel cannot find the model: pass model_fn= (a zero-arg callable returning the "
            "live model), or attach it to a controller whose trainer or evaluator has a .model"
        )

    def _inputs(self) -> tuple[Any, ...] | None:
        if not self._inputs_resolved and self._task is not None:
            self._inputs_resolved = True
            try:
                self._example_inputs = as_inputs(self._task.example_inputs())
            except NotImplementedError:
                if traced_formats(self.formats) and not has_export_signatures(self._task):
                    raise  # with signatures, export_task_model checks each one's inputs
        return self._example_inputs

    def __call__(self, output: Mapping[str, Any]) -> str | None:
        if not _is_rank_zero():
            return None
        directory = self.file_manager.next_name()
        metadata: dict[str, Any] = {"metrics": dict(output or {})}
        if self._run is not None:
            metadata["step"] = int(self._run.global_step)
        if self._task is not None:
            export_task_model(self._task, self._model(), directory, self.formats, example_inputs=self._inputs(),
                              metadata=metadata, spec=self._spec)
        else:
            export_model(self._model(), directory, self.formats, example_inputs=self._inputs(), metadata=metadata,
                         spec=self._spec)
        self.file_manager.clean_up()
        return directory

    def __repr__(self) -> str:
        return f"ExportModel(formats={list(self.formats)}, file_manager={self.file_manager!r})"
