"""Saving and restoring what exact resume needs: RNG states, weights, optimizer state.

* RNG states (Python ``random``, NumPy's legacy global RNG, torch CPU and every CUDA device) as
  JSON; torch's byte states are base64-encoded.
* Model weights as safetensors (:mod:`cadence.torch.safetensors_io`); tied / shared parameters
  are stored once and their other names recorded as aliases in the file's metadata.
* Optimizer / scheduler / grad-scaler state with ``torch.save``; loaded only with
  ``torch.load(weights_only=True)``. A file that would need arbitrary unpickling is refused
  with :class:`~cadence.errors.UnsafeCheckpointError` and nothing in it runs.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import random
import re
from collections import OrderedDict
from typing import IO, Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from cadence.errors import CheckpointError, UnsafeCheckpointError
from cadence.torch.safetensors_io import (  # noqa: F401 - re-exported: their home was here
    ALIASES_KEY,
    SafetensorsPayload,
    safetensors_metadata,
    safetensors_views,
    state_dict_from_safetensors,
    state_dict_to_safetensors,
)
from cadence.torch.wrapper_keys import match_saved_keys
from cadence.torch.staging import PLAIN_LEAVES, clone_tree, copy_tensor, staged  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
"""Model weights in a checkpoint (safetensors)."""
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
"""Optimizer / LR scheduler / grad-scaler state in a checkpoint: tensors plus a JSON structure
(:mod:`cadence.torch.tensor_tree`); nothing pickled."""
OPTIMIZER_FILE = "optimizer.pt"
"""The same state with ``torch.save`` (weights-only loadable): written when the state holds a value
the safetensors form does not represent, and by cadence before 0.3; both load."""

# -- RNG ---------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def get_rng_state() -> dict[str, Any]:
    """The global RNG states of Python, NumPy, torch CPU and (when available) all CUDA devices, as JSON."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_internal), "gauss_next": py_gauss},
        "numpy": {
            "bit_generator": np_name,
            "keys": base64.b64encode(np.asarray(np_keys, dtype="<u4").tobytes()).decode("ascii"),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states from :func:`get_rng_state`; missing entries are left alone.

    CUDA states are restored for the devices present (a warning if the count differs); without
    CUDA they are ignored.
    """
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "numpy" in state:
        n = state["numpy"]
        keys = np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32)
        np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "torch" in state:
        torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint holds CUDA RNG states but CUDA is not available: not restored")
        else:
            n_dev = torch.cuda.device_count()
            if n_dev != len(cuda):
                log.warning("checkpoint holds %d CUDA RNG states, %d devices present", len(cuda), n_dev)
            for i, s in enumerate(cuda[:n_dev]):
                torch.cuda.set_rng_state(_unb64(s), i)


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RNGSnapshot:
    """An in-memory copy of the global RNG states (cheaper than JSON), restored by ``restore()``."""

    def __init__(self) -> None:
        self._python = random.getstate()
        self._numpy = np.random.get_state()
        self._torch = torch.get_rng_state()
        # Only touch CUDA if it is already in use: querying it would initialise it.
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        random.setstate(self._python)
        np.random.set_state(self._numpy)
        torch.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


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


def load_model_safetensors(model: nn.Module, data: bytes | bytearray | memoryview, *,
                           source: str = "model.safetensors",
                           load: Callable[[Mapping[str, torch.Tensor]], Any] | None = None) -> None:
    """Load safetensors bytes into the (unwrapped) model, strictly: each tensor is copied once,
    from a view of ``data`` (:func:`safetensors_views`) straight into its parameter or buffer.
    ``load``: what loads the checked tensors instead of ``model.load_state_dict(tensors,
    strict=True)`` (a sharded model's loader). Keys written through a wrapper (``_orig_mod.`` of
    ``torch.compile``, ``module.`` of DDP, by another tool) are matched to the model's
    (:func:`~cadence.torch.wrapper_keys.match_saved_keys`).

    Raises :class:`~cadence.errors.CheckpointError` naming ``source`` and the missing /
    unexpected keys, or the shape mismatch.
    """
    target = unwrap_model(model)
    try:
        tensors = safetensors_views(data)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e
    expected = target.state_dict().keys()
    tensors = match_saved_keys(tensors, expected)  # another tool's file: keys of a compiled / DDP-wrapped model
    mismatch = describe_key_mismatch((k for k in expected if k not in tensors), (k for k in tensors if k not in expected))
    if mismatch:
        raise CheckpointError(f"{source} does not match the model ({type(target).__name__}): {mismatch}")
    try:
        if load is not None:
            load(tensors)
        else:
            target.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{source} does not match the model ({type(target).__name__}): {e}") from e


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
