"""Export signatures: several named inference entry points of a model, exported together.

:class:`ExportSignature` (see :meth:`Task.export_signatures`) names one entry point.
:func:`export_model_signatures` writes one export per signature (as
:func:`~cadence.torch.export.api.export_model` does) into ``<directory>/<signature>/``, each one
loadable with :func:`~cadence.torch.export.api.load_exported`, and ``<directory>/signatures.json``
last: the signatures, the formats and the caller's metadata (:func:`read_signatures` reads it).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from typing import Any, Mapping, Sequence

from torch import nn

from cadence.storage import Storage
from cadence.torch.export.capture import CallableModule, ExportJob, modes_restored
from cadence.torch.export.dynamic_shapes import check_spec
from cadence.torch.export.formats import FILES, ExportError, check_formats, require_onnx, traced_formats
from cadence.torch.export.metadata import METADATA_VERSION, SIGNATURES_FILE, caller_metadata, describe_input
from cadence.torch.export.staging import stage_and_publish, user_path
from cadence.torch.export.writers import write_export
from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.task.export_specs import ExportSignature
from cadence.torch.task.task import Task

log = logging.getLogger(__name__)

_SIGNATURE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _signature_module(sig: ExportSignature, model: nn.Module | None) -> nn.Module:
    if isinstance(sig.module, nn.Module):
        return unwrap_model(sig.module)
    return CallableModule(sig.module, None if model is None else unwrap_model(model))


def check_signatures(
    signatures: Mapping[str, ExportSignature], formats: str | Sequence[str]
) -> dict[str, ExportSignature]:
    """``signatures`` as a dict, checked for export in ``formats``.

    Raises ``TypeError`` for a non-mapping or a value that is not an :class:`ExportSignature`, and
    ``ValueError`` for a name that is not a safe directory name (``[A-Za-z0-9_.-]+``, not ``.``,
    ``..`` or ``signatures.json``), a signature without example inputs when a format traces the
    model, or a spec that does not fit its example inputs; each error names the signature.
    """
    formats = check_formats(formats)
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
        if sig.example_inputs is None and traced_formats(formats):
            names = ", ".join(repr(f) for f in traced_formats(formats))
            raise ValueError(
                f"export signature {name!r} has no example_inputs, and export format(s) {names} trace it: "
                f"give ExportSignature(module, example_inputs=(tensor, ...)), batch dimension first "
                f"with batch size >= 2"
            )
        if sig.spec is not None and sig.example_inputs is not None and traced_formats(formats):
            try:
                check_spec(sig.spec, sig.example_inputs)
            except ValueError as e:
                raise ValueError(f"export signature {name!r}: {e}") from e
        out[name] = sig
    return out


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
    ``directory`` is created, or replaced as a whole when it is empty or a cadence export (else
    refused, as :func:`export_model`), all at once on local disks. ``model``: the
    model the signatures were built from; a plain-callable signature registers it (traced as
    parameters, in eval mode, saved as its safetensors). Modules are traced in eval mode on CPU
    (plain callables must already be there) and their modes are restored afterwards.

    Raises ``TypeError`` / ``ValueError`` (naming the signature) for a bad name, a value that is
    not an :class:`ExportSignature`, missing example inputs for a traced format, or an unknown
    format, and ``ValueError`` for no signatures; :class:`ExportDependencyError`,
    :class:`ExportError` (naming the signature) and ``ExportTargetError`` as :func:`export_model`. Nothing is published on
    failure.
    """
    formats = check_formats(formats)
    checked = check_signatures(signatures, formats)
    if not checked:
        raise ValueError("export_model_signatures: no signatures given (use export_model for one model)")
    if "onnx" in formats:
        require_onnx()
    extra = caller_metadata(metadata)
    storage = Storage(directory)
    modules = {name: _signature_module(sig, model) for name, sig in checked.items()}
    jobs = {name: ExportJob(modules[name], checked[name].example_inputs, checked[name].spec) for name in checked}
    with modes_restored(list(modules.values())), stage_and_publish(storage) as stage:
        for name, job in jobs.items():
            os.makedirs(os.path.join(stage, name))
            try:
                write_export(job, os.path.join(stage, name), formats, {**extra, "signature": name})
            except ExportError as e:
                raise type(e)(f"export signature {name!r}: {e}") from e
        listing = {
            "format_version": METADATA_VERSION,
            "signatures": {
                name: {
                    "directory": name,
                    "model_class": job.model_class,
                    "inputs": [describe_input(x) for x in job.example_inputs] if job.example_inputs is not None else None,
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
        name: {fmt: user_path(storage, directory, f"{name}/{FILES[fmt]}") for fmt in formats} for name in checked
    }


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


def has_export_signatures(task: Task) -> bool:
    """Whether ``task``'s class overrides :meth:`Task.export_signatures` (it may still return ``{}``)."""
    return type(task).export_signatures is not Task.export_signatures
