"""Saving and restoring what exact resume needs: RNG states, weights, optimizer state.

* RNG states (Python ``random``, NumPy's legacy global RNG, torch CPU and every CUDA device) as
  JSON; torch's byte states are base64-encoded.
* Model weights as safetensors bytes; tied / shared parameters are stored once and their other
  names recorded as aliases in the file's metadata.
* Optimizer / scheduler / grad-scaler state with ``torch.save``; loaded only with
  ``torch.load(weights_only=True)``. A file that would need arbitrary unpickling is refused
  with :class:`~cadence.errors.UnsafeCheckpointError` and nothing in it runs.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
import math
import pickle
import random
import re
import struct
import warnings
from collections import OrderedDict
from typing import IO, Any, Callable, Mapping

import numpy as np
import safetensors.torch
import torch
from torch import nn

from cadence.errors import CheckpointError, UnsafeCheckpointError

log = logging.getLogger(__name__)

ALIASES_KEY = "cadence.aliases"
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


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsPayload:
    """Tensors ready to be written as one safetensors file: on CPU, contiguous, not sharing memory.

    Tied entries (the same tensor under several names) are kept once; ``aliases`` maps each
    other name to the stored one. Built by :meth:`from_state_dict`.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.tensors = tensors
        self.aliases = aliases
        self.metadata = {"format": "pt", **(metadata or {})}
        if aliases:
            self.metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        *,
        copy: bool = False,
        reuse: SafetensorsPayload | None = None,
    ) -> SafetensorsPayload:
        """``copy=False`` keeps CPU tensors as they are (written before they change: a synchronous
        save); ``copy=True`` snapshots every tensor (an asynchronous save), into ``reuse``'s
        tensors where names, shapes and dtypes match (a previous snapshot no longer needed:
        no new memory to allocate and fault in). Tensors that merely overlap another one's
        storage, and views not covering their storage, are always copied."""
        previous = reuse.tensors if reuse is not None else {}
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        canonical: dict[tuple[Any, ...], str] = {}
        storages: set[tuple[Any, int]] = set()
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
            t = t.detach()
            if t.numel() > 0:
                key = _alias_key(t)
                if key in canonical:
                    aliases[name] = canonical[key]
                    continue
                canonical[key] = name
                storage = (t.device, t.untyped_storage().data_ptr())
                shared = storage in storages
                storages.add(storage)
            else:
                shared = True
            if copy:
                tensors[name] = copy_tensor(t, previous.get(name))
                continue
            out = t.to("cpu").contiguous()
            # safetensors refuses tensors sharing memory, and a view must not drag its whole storage.
            if shared or out.untyped_storage().nbytes() != out.numel() * out.element_size():
                out = out.clone()
            tensors[name] = out
        return cls(tensors, aliases, metadata)

    def to_bytes(self) -> bytes:
        """The safetensors file as bytes (safetensors' own serialiser)."""
        return safetensors.torch.save(self.tensors, metadata=self.metadata)

    def write(self, f: IO[bytes]) -> None:
        """Stream the safetensors file into ``f`` without building it in memory: the header, then
        each tensor's bytes straight from its memory (the safetensors format: an 8-byte
        little-endian header length, a JSON header padded to 8 bytes, the data; tensors ordered
        by element size, largest first, so each one is aligned). Loads with safetensors' reader."""
        if any(t.dtype not in _SAFETENSORS_DTYPES for t in self.tensors.values()):
            f.write(self.to_bytes())  # a dtype this writer does not map: the library serialises it
            return
        order = sorted(self.tensors, key=lambda k: (-self.tensors[k].element_size(), k))
        header: dict[str, Any] = {}
        offset = 0
        for name in order:
            t = self.tensors[name]
            size = t.numel() * t.element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = self.metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            t = self.tensors[name]
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def state_dict_to_safetensors(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise tensors to safetensors bytes (moved to CPU, contiguous).

    Entries that are the same tensor (tied weights) are stored once; the other names are
    recorded in the metadata under ``"cadence.aliases"`` (JSON ``{alias: stored name}``).
    Tensors that merely overlap another one's storage are copied. To write a file without
    building it in memory, use :meth:`SafetensorsPayload.write`.
    """
    return SafetensorsPayload.from_state_dict(state_dict, metadata).to_bytes()


def safetensors_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (read from the JSON header, nothing else parsed)."""
    if len(data) < 8:
        raise CheckpointError("not a safetensors file: too short")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError("not a safetensors file: bad header length")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:
        raise CheckpointError(f"not a safetensors file: {e}") from e
    return dict(header.get("__metadata__") or {})


_DTYPES_BY_NAME = {
    **{name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()},
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit


def safetensors_views(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of safetensors ``data`` as views of its bytes: nothing is copied, so they are
    valid while ``data`` is and must be copied (``load_state_dict``) before ``data`` changes.
    Aliases (see :func:`state_dict_to_safetensors`) share the stored tensor.

    The header is checked as strictly as safetensors does (length, JSON, dtypes, shapes, offsets
    inside the data and matching the shape, no overlaps); a violation raises
    :class:`~cadence.errors.CheckpointError`. A read-only ``data`` gives read-only views.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise CheckpointError("not a safetensors file: too short")
    (n,) = struct.unpack("<Q", view[:8])
    if n > view.nbytes - 8 or n > _MAX_HEADER:
        raise CheckpointError(f"not a safetensors file: bad header length {n}")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except ValueError as e:
        raise CheckpointError(f"not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError("not a safetensors file: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if any(isinstance(e, dict) and e.get("dtype") not in _DTYPES_BY_NAME for e in header.values()):
        tensors = _library_load(view)  # a dtype without a torch mapping here: safetensors' own reader
    else:
        tensors = _views(view, header, 8 + n)
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}")) if isinstance(metadata, dict) else {}
    for alias, name in aliases.items():
        if name not in tensors:
            raise CheckpointError(f"not a safetensors file: alias {alias!r} names no tensor ({name!r})")
        tensors[alias] = tensors[name]
    return tensors


def _library_load(view: memoryview) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(bytes(view))
    except Exception as e:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"unreadable safetensors data: {e}") from e


def _views(view: memoryview, header: dict[str, Any], start: int) -> dict[str, torch.Tensor]:
    size = view.nbytes - start
    tensors: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    with warnings.catch_warnings():  # a read-only buffer: the views are only ever read
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.items():
            dtype, shape, begin, end = _entry(name, entry, size)
            spans.append((begin, end, name))
            numel = math.prod(shape)
            flat = (torch.frombuffer(view, dtype=dtype, count=numel, offset=start + begin) if numel
                    else torch.empty(0, dtype=dtype))
            tensors[name] = flat.view(shape)
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"not a safetensors file: tensors {first!r} and {second!r} overlap")
    return tensors


def _entry(name: str, entry: Any, size: int) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, checked against the data's ``size``."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"not a safetensors file: entry {name!r} is not an object")
    dtype = _DTYPES_BY_NAME[entry["dtype"]]
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"not a safetensors file: {name!r} has a bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= size):
        raise CheckpointError(f"not a safetensors file: {name!r} has bad data_offsets {offsets!r} (data: {size} bytes)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise CheckpointError(f"not a safetensors file: {name!r}'s data_offsets {offsets} do not hold shape {shape}")
    return dtype, shape, offsets[0], offsets[1]


def state_dict_from_safetensors(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors from :func:`state_dict_to_safetensors` bytes, aliases filled in (sharing the
    tensor); each one a copy that owns its memory (:func:`safetensors_views`: without the copy)."""
    views = safetensors_views(data)
    copies: dict[int, torch.Tensor] = {}
    return {name: copies.setdefault(id(t), t.clone()) for name, t in views.items()}


def model_to_safetensors(model: nn.Module) -> bytes:
    """The (unwrapped) model's ``state_dict`` as safetensors bytes."""
    return state_dict_to_safetensors(unwrap_model(model).state_dict())


def _names(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_model_safetensors(model: nn.Module, data: bytes | bytearray | memoryview, *,
                           source: str = "model.safetensors",
                           load: Callable[[Mapping[str, torch.Tensor]], Any] | None = None) -> None:
    """Load safetensors bytes into the (unwrapped) model, strictly: each tensor is copied once,
    from a view of ``data`` (:func:`safetensors_views`) straight into its parameter or buffer.
    ``load``: what loads the checked tensors instead of ``model.load_state_dict(tensors,
    strict=True)`` (a sharded model's loader).

    Raises :class:`~cadence.errors.CheckpointError` naming ``source`` and the missing /
    unexpected keys, or the shape mismatch.
    """
    target = unwrap_model(model)
    try:
        tensors = safetensors_views(data)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e
    expected = target.state_dict().keys()
    missing = sorted(k for k in expected if k not in tensors)
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_names(unexpected)}")
        raise CheckpointError(
            f"{source} does not match the model ({type(target).__name__}): " + "; ".join(parts)
        )
    try:
        if load is not None:
            load(tensors)
        else:
            target.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{source} does not match the model ({type(target).__name__}): {e}") from e


# -- optimizer / scheduler / scaler ------------------------------------------------------------


_PLAIN_LEAVES = (str, int, float, bool, complex, bytes, type(None), torch.dtype, torch.device, torch.Size)
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple)


def _plainly_loadable(obj: Any, depth: int = 0) -> bool:
    """True when ``obj`` is made only of what ``torch.load(weights_only=True)`` always accepts:
    dense plain tensors, numbers, strings, bytes, None, dtypes, devices, sizes, and dicts / lists /
    tuples of them. False means "not sure" (another type, or nesting deeper than 64 levels)."""
    kind = type(obj)
    if kind is torch.Tensor:
        return obj.layout == torch.strided and not obj.is_quantized
    if kind in _PLAIN_LEAVES:
        return True
    if depth > 64 or kind not in _PLAIN_CONTAINERS:
        return False
    if kind in (dict, OrderedDict):
        return all(type(k) in _PLAIN_LEAVES and _plainly_loadable(v, depth + 1) for k, v in obj.items())
    return all(_plainly_loadable(v, depth + 1) for v in obj)


def copy_tensor(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous CPU copy of ``t``, written into ``into`` when that is a contiguous CPU tensor of
    the same shape and dtype (no allocation), else into a new tensor.

    A CUDA tensor is staged into *pinned* memory with a non-blocking copy: the call returns while
    the device-to-host transfer runs on the current stream, so the copy must not be read before
    :func:`staged` says so (an asynchronous save's writer thread waits for it)."""
    source = t.detach()
    cuda = source.device.type == "cuda"
    if (
        into is not None and into.device.type == "cpu" and into.shape == t.shape and into.dtype == t.dtype
        and into.is_contiguous() and into.data_ptr() != t.data_ptr() and (not cuda or into.is_pinned())
    ):
        return into.copy_(source, non_blocking=cuda)
    if cuda:
        pinned = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        return pinned.copy_(source, non_blocking=True)
    return source.to("cpu", copy=True).contiguous()


def staged(devices: set[torch.device]) -> Any:
    """An event to wait on (``.synchronize()``) before reading copies that :func:`copy_tensor` made
    from CUDA tensors on ``devices``; None when there are none (CPU copies are done on return).
    Recorded on each device's current stream, after the copies were queued."""
    events = []
    for device in sorted((d for d in devices if d.type == "cuda"), key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return _Events(events) if events else None


class _Events:
    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def synchronize(self) -> None:
        for event in self._events:
            event.synchronize()


def clone_tree(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are copied to CPU (a snapshot of optimizer state): dicts,
    lists and tuples are rebuilt, tensors copied (into the tensor at the same place in ``reuse``,
    a previous copy no longer needed, when it fits: see :func:`copy_tensor`), anything else
    deep-copied."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        return copy_tensor(obj, reuse if isinstance(reuse, torch.Tensor) else None)
    if kind in (dict, OrderedDict):
        old = reuse if isinstance(reuse, dict) else {}
        return kind((k, clone_tree(v, old.get(k))) for k, v in obj.items())
    if kind in (list, tuple):
        previous = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return kind(clone_tree(v, r) for v, r in zip(obj, previous))
    if kind in _PLAIN_LEAVES:
        return obj
    return copy.deepcopy(obj)


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
