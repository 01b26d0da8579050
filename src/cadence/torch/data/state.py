"""A train data's position in ``state.json``: JSON, with the few values JSON lacks tagged.

A loader's ``state_dict`` may hold tensors (torchdata's ``StatefulDataLoader`` keeps its
sampler's random generator state as a ``uint8`` tensor), dicts with integer keys (per-worker
states) and tuples. :func:`to_json` turns each into a tagged JSON object and :func:`from_json`
turns it back, so the state loaded is the state saved, type for type. Values of any other type
raise ``TypeError`` naming where they are.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

__all__ = ["from_json", "to_json"]

_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"
_TAGS = (_TENSOR, _DICT, _TUPLE)


def to_json(obj: Any, where: str = "data") -> Any:
    """``obj`` as JSON-serialisable values (see the module doc)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TENSOR: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "data": base64.b64encode(data).decode("ascii")}}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: to_json(v, f"{where}.{k}") for k, v in obj.items()}
        return {_DICT: [[to_json(k, where), to_json(v, f"{where}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"the train data's state holds a {type(obj).__name__} at {where}, which a checkpoint's "
                    "state.json cannot hold (JSON values, tensors, tuples and dicts only)")


def from_json(obj: Any) -> Any:
    """The value :func:`to_json` encoded as ``obj``."""
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == _TENSOR:
            dtype = getattr(torch, value["dtype"])
            raw = bytearray(base64.b64decode(value["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).clone()
        if tag == _DICT:
            return {from_json(k): from_json(v) for k, v in value}
        if tag == _TUPLE:
            return tuple(from_json(v) for v in value)
    return {k: from_json(v) for k, v in obj.items()}
