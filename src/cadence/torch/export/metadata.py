"""``metadata.json`` (one export's formats, files, model class, inputs and versions, and the
caller's metadata) and the names of the files that mark an export complete."""

from __future__ import annotations

import datetime
from typing import Any, Mapping

import numpy as np
import torch

from cadence.torch.export.capture import ExportJob

__all__ = ["METADATA_FILE", "METADATA_VERSION", "SIGNATURES_FILE", "caller_metadata", "describe_input",
           "export_metadata"]

METADATA_FILE = "metadata.json"
METADATA_VERSION = 1
SIGNATURES_FILE = "signatures.json"
"""Beside the signature directories of an export with signatures; written last."""
_RESERVED_KEYS = frozenset(
    {"format_version", "formats", "files", "model_class", "inputs", "cadence_version", "torch_version", "created_at",
     "signature", "signatures"}
)


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


def caller_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    extra = _jsonable(dict(metadata or {}))
    clash = sorted(_RESERVED_KEYS.intersection(extra))
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by cadence's metadata.json")
    return extra


def describe_input(x: Any) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
    return {"type": type(x).__name__}


def export_metadata(job: ExportJob, infos: dict[str, dict[str, Any]], files: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    import cadence

    inputs = job.example_inputs
    return {
        "format_version": METADATA_VERSION,
        "formats": infos,
        "files": files,
        "model_class": job.model_class,
        "inputs": [describe_input(x) for x in inputs] if inputs is not None else None,
        "cadence_version": cadence.__version__,
        "torch_version": torch.__version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
