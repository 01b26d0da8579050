"""Optimizer, scheduler and grad-scaler state as safetensors: the tensors in the file's data, the
structure around them as JSON in its metadata. Nothing is pickled, and loading takes each tensor
from a view of the verified file bytes (no ``torch.load``, which copies every storage through its
zip reader).

The structure (*skeleton*) is plain JSON with four tagged forms for what JSON lacks: a tensor is
``{"$tensor": name}``, a tuple ``{"$tuple": [...]}``, a dict whose keys are not all strings (an
optimizer's state is keyed by parameter index) ``{"$items": [[key, value], ...]}``, and
``{"$dtype": "float32"}`` / ``{"$device": "cuda:0"}`` / ``{"$size": [..]}``. A dict with a string
key starting with ``$`` goes through ``$items`` too, so no user key is mistaken for a tag.
A state holding anything else (a complex number, bytes, a custom class) is not flattened:
:func:`flatten` raises :class:`NotFlat` and the caller keeps ``torch.save``.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any, Mapping

import torch

from cadence.errors import CheckpointError
from cadence.torch.checkpoint_io.resident import empty_resident
from cadence.torch.checkpoint_io.safetensors_io import SafetensorsPayload, safetensors_metadata, safetensors_views

__all__ = ["TREE_KEY", "NotFlat", "flatten", "payload", "load_tree"]

TREE_KEY = "cadence.tree"
"""The safetensors metadata key holding the JSON skeleton."""

_MAX_DEPTH = 64


class NotFlat(Exception):
    """The state holds a value this format does not represent (the message says which, where)."""


def flatten(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)`` of ``obj`` (see the module doc); tensor names are their paths,
    made unique. Raises :class:`NotFlat`."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise NotFlat(f"{path or 'the state'} nests deeper than {_MAX_DEPTH} levels")
        kind = type(value)
        if kind is torch.Tensor or isinstance(value, torch.nn.Parameter):
            if value.layout != torch.strided or value.is_quantized:
                raise NotFlat(f"{path}: a {value.layout} tensor")
            name = path or "tensor"
            if name in tensors:
                name = f"{name}#{len(tensors)}"
            tensors[name] = value.detach()
            return {"$tensor": name}
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if kind in (list, tuple):
            items = [walk(v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(value)]
            return items if kind is list else {"$tuple": items}
        if kind in (dict, OrderedDict):
            if all(type(k) is str and not k.startswith("$") for k in value):
                return {k: walk(v, f"{path}.{k}" if path else k, depth + 1) for k, v in value.items()}
            return {"$items": [[walk(k, f"{path}.<key>", depth + 1), walk(v, f"{path}.{k}" if path else str(k), depth + 1)]
                               for k, v in value.items()]}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"$device": str(value)}
        if kind is torch.Size:
            return {"$size": list(value)}
        raise NotFlat(f"{path or 'the state'}: a {kind.__name__} value")

    try:
        return walk(obj, "", 0), tensors
    finally:
        walk = None  # type: ignore[assignment]  # break the closure's cycle: no garbage to collect


def payload(obj: Any, metadata: Mapping[str, str] | None = None) -> SafetensorsPayload:
    """The safetensors file of ``obj`` (tensors moved to CPU, contiguous; a tensor shared within
    ``obj`` is written under each name and loaded back as one). Raises :class:`NotFlat`."""
    skeleton, tensors = flatten(obj)
    return SafetensorsPayload.from_state_dict(tensors, {**(metadata or {}), TREE_KEY: json.dumps(skeleton)})


def load_tree(data: bytes | bytearray | memoryview, *, source: str, map_location: torch.device | str = "cpu",
              into: Any = None) -> Any:
    """The object saved by :func:`payload`, its tensors copied once from views of ``data`` onto
    ``map_location`` (they own their memory; ``data`` may be dropped).

    ``into``: a live object of the same structure (``{"optimizer": optimizer.state_dict()}``)
    whose tensors receive the loaded values where they can: a tensor at the same place in the
    structure with the same shape, dtype and device (on ``map_location``), that owns its memory,
    does not require grad and appears once, is copied into and returned in place of a new one (no
    memory to allocate, and none to free when the optimizer drops its old state); the others are
    copied into new memory, faulted in at once on CPU
    (:func:`~cadence.torch.checkpoint_io.resident.empty_resident`). The live tensors are written only
    once the whole structure has been read: a malformed file leaves them as they were; a later
    failure (an optimizer refusing the state) leaves them holding the loaded values.

    Raises :class:`~cadence.errors.CheckpointError` naming ``source`` when the file or its
    skeleton is malformed."""
    try:
        views = safetensors_views(data)
        skeleton = json.loads(safetensors_metadata(data)[TREE_KEY])
    except KeyError:
        raise CheckpointError(f"{source}: no {TREE_KEY!r} in the file's metadata") from None
    except (CheckpointError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from e
    device = torch.device(map_location)
    copies: dict[int, torch.Tensor] = {}  # a tensor shared by several places (aliases) is loaded once
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, view): copied once all is read
    claimed: set[int] = set()  # the live tensors' memory already given a value

    def tensor(view: torch.Tensor, live: Any) -> torch.Tensor:
        if _reusable(live, view, device) and live.data_ptr() not in claimed:
            claimed.add(live.data_ptr())
            pending.append((live, view))
            return live
        if device.type == "cpu":  # new memory (an optimizer without state yet): faulted in at once
            return empty_resident(view.shape, view.dtype).copy_(view)
        return view.to(device, copy=True)

    def build(node: Any, live: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{source}: the state nests deeper than {_MAX_DEPTH} levels")
        if isinstance(node, list):
            return [build(v, _item(live, i), depth + 1) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((tag, value),) = node.items()
            if tag == "$tensor":
                if value not in views:
                    raise CheckpointError(f"{source}: the structure names a tensor {value!r} that is not in the file")
                view = views[value]
                if id(view) not in copies:
                    copies[id(view)] = tensor(view, live)
                return copies[id(view)]
            if tag == "$tuple":
                return tuple(build(v, _item(live, i), depth + 1) for i, v in enumerate(value))
            if tag == "$items":
                items = {}
                for k, v in value:
                    key = build(k, None, depth + 1)
                    items[key] = build(v, _entry(live, key), depth + 1)
                return items
            if tag == "$float":
                return float(value)
            if tag == "$dtype":
                dtype = getattr(torch, value, None) if isinstance(value, str) else None
                if not isinstance(dtype, torch.dtype):
                    raise CheckpointError(f"{source}: {value!r} is not a torch dtype")
                return dtype
            if tag == "$device":
                return torch.device(value)
            if tag == "$size":
                return torch.Size(value)
        return {k: build(v, _entry(live, k), depth + 1) for k, v in node.items()}

    try:
        tree = build(skeleton, into, 0)
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{source}: malformed state structure ({type(e).__name__}: {e})") from e
    finally:  # break the closures' cycle, which holds the views: the mapped file goes at once
        build = tensor = None  # type: ignore[assignment]
    with torch.no_grad():
        for live, view in pending:
            live.copy_(view)
    return tree


def _item(live: Any, index: int) -> Any:
    return live[index] if isinstance(live, (list, tuple)) and index < len(live) else None


def _entry(live: Any, key: Any) -> Any:
    return live.get(key) if isinstance(live, Mapping) else None


def _reusable(live: Any, view: torch.Tensor, device: torch.device) -> bool:
    """Whether ``live`` may receive ``view``'s values in place (see :func:`load_tree`'s ``into``)."""
    return (type(live) is torch.Tensor and live.shape == view.shape and live.dtype == view.dtype
            and live.device.type == device.type and (device.index is None or live.device.index == device.index)
            and not live.requires_grad and live.numel() > 0 and live.is_contiguous() and live.storage_offset() == 0
            and live.untyped_storage().nbytes() == live.numel() * live.element_size())
