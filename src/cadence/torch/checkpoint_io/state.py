"""Saving and restoring model weights and optimizer state (the RNG states: :mod:`cadence.torch.runtime.rng`).

* Model weights as safetensors (:mod:`cadence.torch.checkpoint_io.safetensors_io`); a tied / shared parameter
  is written under each of its names (a plain ``load_state_dict(load_file(...))`` works), its other names also
  recorded as aliases in the file's metadata and loaded back as one tensor.
* Optimizer / scheduler / grad-scaler state with ``torch.save``; loaded only with
  ``torch.load(weights_only=True)``. A file that would need arbitrary unpickling is refused
  with :class:`~cadence.errors.UnsafeCheckpointError` and nothing in it runs.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
from collections import OrderedDict
from typing import IO, Any, Callable, Iterable, Mapping

import torch
from torch import nn

from cadence.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from cadence.torch.checkpoint_io.safetensors_io import (  # noqa: F401 - re-exported: their home was here
    ALIASES_KEY,
    SafetensorsPayload,
    safetensors_metadata,
    safetensors_views,
    state_dict_from_safetensors,
    state_dict_to_safetensors,
)
from cadence.torch.checkpoint_io.wrapper_keys import match_saved_keys
from cadence.torch.checkpoint_io.staging import PLAIN_LEAVES, clone_tree, copy_tensor, staged  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
"""Model weights in a checkpoint (safetensors)."""
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
"""Optimizer / LR scheduler / grad-scaler state in a checkpoint: tensors plus a JSON structure
(:mod:`cadence.torch.checkpoint_io.tensor_tree`); nothing pickled."""
OPTIMIZER_FILE = "optimizer.pt"
"""The same state with ``torch.save`` (weights-only loadable): written when the state holds a value
the safetensors form does not represent, and by cadence before 0.3; both load."""

# -- model weights -----------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


def model_to_safetensors(model: nn.Module) -> bytes:
    """The (unwrapped) model's ``state_dict`` as safetensors bytes."""
    return state_dict_to_safetensors(unwrap_model(model).state_dict())


def _names(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def describe_key_mismatch(missing: Iterable[str], unexpected: Iterable[str]) -> str:
    """``"missing keys: a, b; unexpected keys: c"`` (sorted; the parts that are not empty; the
    first 10 of each); ``""`` when both are empty. What a state that does not match its model says."""
    parts = [f"{what} keys: {_names(sorted(keys))}" for what, keys in (("missing", list(missing)),
                                                                       ("unexpected", list(unexpected))) if keys]
    return "; ".join(parts)


def describe_shape_mismatch(saved: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """``"'0.weight' has shape (16, 8) in the checkpoint, (64, 8) in the model (and 2 more tensors
    differ in shape)"``: the first key of ``model`` (in its order) whose tensor in ``saved`` has
    another shape, and how many more do; ``""`` when none does. Keys in only one of them are
    :func:`describe_key_mismatch`'s."""
    differ = [k for k, t in model.items() if k in saved and tuple(saved[k].shape) != tuple(t.shape)]
    if not differ:
        return ""
    first = differ[0]
    more = len(differ) - 1
    return (f"{first!r} has shape {tuple(saved[first].shape)} in the checkpoint, {tuple(model[first].shape)} in the "
            f"model" + (f" (and {more} more tensor{'s' if more > 1 else ''} differ{'' if more > 1 else 's'} in shape)"
                        if more else ""))


def load_model_safetensors(model: nn.Module, data: bytes | bytearray | memoryview, *,
                           source: str = "model.safetensors",
                           load: Callable[[Mapping[str, torch.Tensor]], Any] | None = None) -> None:
    """Load safetensors bytes into the (unwrapped) model, strictly: each tensor is copied once,
    from a view of ``data`` (:func:`safetensors_views`) straight into its parameter or buffer.
    ``load``: what loads the checked tensors instead of ``model.load_state_dict(tensors,
    strict=True)`` (a sharded model's loader). Keys written through a wrapper (``_orig_mod.`` of
    ``torch.compile``, ``module.`` of DDP, by another tool) are matched to the model's
    (:func:`~cadence.torch.checkpoint_io.wrapper_keys.match_saved_keys`).

    Raises :class:`~cadence.errors.CheckpointMismatchError` (bad input: the config builds
    another model) in one line naming ``source`` and the missing / unexpected keys, or the first
    tensor of another shape with both shapes and how many more differ; nothing is loaded then.
    """
    target = unwrap_model(model)
    try:
        tensors = safetensors_views(data)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e
    expected = target.state_dict()
    tensors = match_saved_keys(tensors, expected.keys())  # another tool's file: keys of a compiled / DDP-wrapped model
    mismatch = (describe_key_mismatch((k for k in expected if k not in tensors), (k for k in tensors if k not in expected))
                or describe_shape_mismatch(tensors, expected))
    if mismatch:
        raise CheckpointMismatchError(f"{source} does not match the model ({type(target).__name__}): {mismatch}")
    try:
        if load is not None:
            load(tensors)
        else:
            target.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        text = " ".join(str(e).split())  # torch's text spans lines: one line
        raise CheckpointError(f"{source} does not match the model ({type(target).__name__}): {text}") from e


# -- optimizer / scheduler / scaler ------------------------------------------------------------


_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple)


def _plainly_loadable(obj: Any, depth: int = 0) -> bool:
    """True when ``obj`` is made only of what ``torch.load(weights_only=True)`` always accepts:
    dense plain tensors, numbers, strings, bytes, None, dtypes, devices, sizes, and dicts / lists /
    tuples of them. False means "not sure" (another type, or nesting deeper than 64 levels)."""
    kind = type(obj)
    if kind is torch.Tensor:
        return obj.layout == torch.strided and not obj.is_quantized
    if kind in PLAIN_LEAVES:
        return True
    if depth > 64 or kind not in _PLAIN_CONTAINERS:
        return False
    if kind in (dict, OrderedDict):
        return all(type(k) in PLAIN_LEAVES and _plainly_loadable(v, depth + 1) for k, v in obj.items())
    return all(_plainly_loadable(v, depth + 1) for v in obj)


def _check_weights_only(data: bytes, name: str) -> None:
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="meta")
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to save {name}: it could not be loaded back with torch.load(weights_only=True) "
            f"({_weights_only_reason(e)}); optimizer, scheduler and grad-scaler state must be made "
            f"of tensors, numbers, strings and containers"
        ) from e


def save_torch_state(f: IO[bytes], obj: Any, name: str = "optimizer.pt") -> None:
    """``torch.save`` ``obj`` into ``f``, guaranteed to load back with ``torch.load(weights_only=True)``.

    When ``obj`` is plainly loadable (tensors, numbers, strings and containers: what optimizer
    state is), it is streamed into ``f`` directly; otherwise it is serialised in memory and
    loaded back first (onto the ``meta`` device: no tensor data is read), and a state that would
    need arbitrary unpickling raises :class:`~cadence.errors.CheckpointError` naming the
    offending type before anything is written.
    """
    if _plainly_loadable(obj):
        torch.save(obj, f)
        return
    f.write(torch_state_to_bytes(obj, name))


def torch_state_to_bytes(obj: Any, name: str = "optimizer.pt") -> bytes:
    """``torch.save`` of ``obj`` as bytes, verified to load back with ``torch.load(weights_only=True)``.

    Raises :class:`~cadence.errors.CheckpointError` naming the offending type otherwise (see
    :func:`save_torch_state`).
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if not _plainly_loadable(obj):
        _check_weights_only(data, name)
    return data


def _weights_only_reason(e: BaseException) -> str:
    msg = str(e)
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|$)", msg, re.S)
    if m:
        return " ".join(m.group(1).split())
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def load_torch_state(data: bytes | bytearray, *, name: str = "optimizer.pt", source: str = "", map_location: Any = "cpu") -> Any:
    """Load ``torch.save`` bytes with ``weights_only=True`` only.

    Raises :class:`~cadence.errors.UnsafeCheckpointError` when the file would need arbitrary
    unpickling (nothing from it runs), :class:`~cadence.errors.CheckpointError` when unreadable.
    """
    where = f"{source}/{name}" if source else name
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"refused to load {where}: it would need arbitrary unpickling, which could run code "
            f"(torch.load(weights_only=True) rejected it: {_weights_only_reason(e)}). "
            f"Nothing from the file was executed."
        ) from e
    except Exception as e:
        raise CheckpointError(f"could not read {where}: {type(e).__name__}: {e}") from e
