"""The safetensors files of a checkpoint: :class:`SafetensorsPayload` streams tensors into a file
from their memory (no serialised copy), :func:`safetensors_views` reads one back as views of its
bytes (no deserialised copy), checked as strictly as safetensors checks them.

Tied entries (one tensor under several names, such as a GPT's ``lm_head.weight`` and token
embedding) are written under every name, so that a plain ``model.load_state_dict(
safetensors.torch.load_file(path))`` of a checkpoint's or an export's file works (the file holds the
tied tensor's bytes once per name; the streaming writer writes them from the one tensor, no copy in
memory). Chosen over a loader of cadence's own, which would keep files smaller but fail every other
reader: users open checkpoints and exports by hand. The other names are also recorded in the file's
metadata under :data:`ALIASES_KEY`, and cadence's readers restore them as the same tensor (tensors
loaded as one state dict stay tied).
Files written before (the tied tensor stored once, the aliases in the metadata only) still load.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import IO, TYPE_CHECKING, Any, Container, Mapping

import safetensors.torch
import torch

from cadence.errors import CheckpointError
from cadence.torch.checkpoint_io.staging import copy_tensor

if TYPE_CHECKING:
    from cadence.torch.checkpoint_io.pipelined import CopyJobs

__all__ = ["ALIASES_KEY", "SafetensorsPayload", "alias_key", "safetensors_metadata", "safetensors_views",
           "state_dict_from_safetensors", "state_dict_to_safetensors"]

ALIASES_KEY = "cadence.aliases"
"""The metadata key naming the aliases of tied tensors (JSON ``{alias: stored name}``)."""


def alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two entries of a state dict one tensor (tied): the same memory, shape, strides and dtype."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsPayload:
    """Tensors ready to be written as one safetensors file: on CPU, contiguous, none sharing memory
    with another (an alias is the same tensor object).

    Tied entries (the same tensor under several names) are one tensor under each name in
    ``tensors`` (written once per name); ``aliases`` maps each other name to the first one
    (recorded in the metadata). Built by :meth:`from_state_dict`.
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
        later: CopyJobs | None = None,
        deferred: Container[str] | None = None,
    ) -> SafetensorsPayload:
        """``copy=False`` keeps CPU tensors as they are (written before they change: a synchronous
        save); ``copy=True`` snapshots every tensor (an asynchronous save), into ``reuse``'s
        tensors where names, shapes and dtypes match (a previous snapshot no longer needed:
        no new memory to allocate and fault in). Tensors that merely overlap another one's
        storage, and views not covering their storage, are always copied.

        ``later`` (with ``copy=True``): the tensors named in ``deferred`` (None: all) are not
        copied now but added to these jobs (a pipelined snapshot: the payload holds the live tensors
        until the jobs run); the others are copied now. A tied name follows its first name."""
        previous = reuse.tensors if reuse is not None else {}
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        canonical: dict[tuple[Any, ...], str] = {}
        storages: set[tuple[Any, int]] = set()
        pending: set[str] = set()  # names whose copy is left to ``later``
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
            t = t.detach()
            if t.numel() > 0:
                key = alias_key(t)
                if key in canonical:
                    aliases[name] = canonical[key]
                    first = tensors[canonical[key]]  # the same tensor: written under both names
                    if later is not None and canonical[key] in pending:
                        later.add(tensors, name, first)
                    else:
                        tensors[name] = first
                    continue
                canonical[key] = name
                storage = (t.device, t.untyped_storage().data_ptr())
                shared = storage in storages
                storages.add(storage)
            else:
                shared = True
            if copy and later is not None and (deferred is None or name in deferred):
                later.add(tensors, name, t, previous.get(name))
                pending.add(name)
                continue
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
        """The safetensors file as bytes (safetensors' own serialiser, which refuses tensors sharing
        memory: each alias is copied)."""
        tensors = {name: t.clone() if name in self.aliases else t for name, t in self.tensors.items()}
        return safetensors.torch.save(tensors, metadata=self.metadata)

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

    Entries that are the same tensor (tied weights) are written under each name (a plain
    ``load_state_dict(load_file(...))`` works); the other names are also recorded in the
    metadata under ``"cadence.aliases"`` (JSON ``{alias: first name}``) for cadence's readers.
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
    Aliases (see :func:`state_dict_to_safetensors`) share their first name's tensor, whether the
    file holds them too or (written before, by cadence) only in its metadata.

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
