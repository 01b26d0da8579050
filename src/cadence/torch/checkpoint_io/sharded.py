"""Sharded checkpoints: every rank writes its own shards through ``torch.distributed.checkpoint``.

A checkpoint of a model sharded with FSDP2 (``trainer.strategy: fsdp`` on several ranks) holds
the model, optimizer and LR-scheduler state in DCP's format, in the checkpoint's directory beside
``state.json``::

    ckpt-200/
      __0_0.distcp  __1_0.distcp ...   rank r's shards (written by rank r, in parallel)
      .metadata                        DCP's index of every tensor's chunks (written by rank 0)
      state.json  MANIFEST.json        as for every checkpoint

Every rank reports the size and checksum of the files it wrote; the chief lists them all, with the
rank that wrote each, in ``MANIFEST.json`` (see :mod:`cadence.checkpoint.manifest`). Loading
reshards: a checkpoint saved on N ranks loads on M, or into a plain module in one process with
no process group (the sidecar, ``cadence export``).

Loading is safe as the rest of cadence is: DCP's ``.metadata`` is unpickled with an allowlist of
DCP's own metadata classes, and its non-tensor values with ``torch.load(weights_only=True)``
(DCP itself unpickles both without restriction).
"""

from __future__ import annotations

import copy

import io
import pickle
import sys
import warnings
from types import SimpleNamespace
from typing import Any, Mapping

import torch
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from cadence.checkpoint import checksum as checksum_lib
from cadence.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from cadence.storage import Storage, local_path
from cadence.torch.checkpoint_io.kinds import METADATA_FILE, is_sharded_checkpoint
from cadence.torch.checkpoint_io.state import describe_key_mismatch, describe_shape_mismatch

__all__ = [
    "METADATA_FILE",
    "is_sharded_checkpoint",
    "load_extra_state",
    "load_model",
    "load_trainer_state",
    "read_model_state",
    "trainer_state",
    "write_shards",
]

# -- the state ----------------------------------------------------------------------------------


def trainer_state(model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None) -> dict[str, Any]:
    """The state a sharded checkpoint holds, as DCP saves and loads it: ``{"model", "optimizer"}``
    (each rank's shards, keyed by parameter FQN, as ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` give them) and ``"lr_scheduler"`` when there is one. The tensors
    are the live ones (not copies)."""
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    return state


def load_trainer_state(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None,
                       *, storage_options: Mapping[str, Any] | None = None) -> None:
    """Load a sharded checkpoint's model, optimizer and scheduler state (collective when a
    process group is initialised: every rank calls it). DCP reshards: each rank reads the chunks
    of its own shards, whatever number of ranks saved them. Raises :class:`CheckpointError` when
    the checkpoint does not hold this model's or optimizer's state."""
    state = trainer_state(model, optimizer, lr_scheduler)
    has_scheduler = lr_scheduler is not None
    _load(state, directory, storage_options, allow_partial=not has_scheduler, strict="model")
    try:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{directory}: the sharded state does not match this model or optimizer: {e}") from e
    _restore_tuples(optimizer)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])


def load_model(directory: str, model: nn.Module, *, storage_options: Mapping[str, Any] | None = None) -> None:
    """Load the model state of a sharded checkpoint into ``model`` (a plain module in a single
    process without a process group -- the sidecar, ``cadence export`` -- or a sharded one on
    every rank): each of its tensors is assembled from the shards of every rank that saved it."""
    state = {"model": get_model_state_dict(model)}
    _load(state, directory, storage_options, allow_partial=True, strict="model")
    try:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{directory}: the sharded model state does not match this model: {e}") from e


def load_extra_state(directory: str, key: str, tensors: Mapping[str, torch.Tensor], *,
                     storage_options: Mapping[str, Any] | None = None) -> bool:
    """Load the tensors a sharded checkpoint holds under the top-level ``key`` (the EMA's ``"ema"``)
    into ``tensors`` in place (DTensor shards, or plain tensors assembled from every rank's shards);
    collective when a process group is initialised. False, loading nothing, when the checkpoint
    holds nothing under ``key``; :class:`CheckpointError` when its entries are not ``tensors``' keys."""
    metadata = _reader(directory, storage_options).read_metadata()
    if not any(name.startswith(f"{key}.") for name in metadata.state_dict_metadata):
        return False
    _load({key: dict(tensors)}, directory, storage_options, allow_partial=True, strict=key)
    return True


def read_model_state(directory: str, *, storage_options: Mapping[str, Any] | None = None,
                     key: str = "model") -> dict[str, torch.Tensor]:
    """The full model state dict (CPU tensors, by parameter FQN) of the sharded checkpoint in
    ``directory``, assembled from every rank's shards in this process, without building the
    model: the tensors' shapes and dtypes are read from DCP's metadata. Checks nothing against the
    manifest: read a checkpoint through :class:`~cadence.checkpoint.CheckpointManager` to verify it.
    ``key``: the top-level key read (``"ema"``: the EMA of the weights)."""
    reader = _reader(directory, storage_options)
    metadata = reader.read_metadata()
    prefix = f"{key}."
    template = {}
    for name, item in metadata.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            template[name[len(prefix):]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not template:
        raise CheckpointError(f"{directory}: the sharded checkpoint holds no {key} state")
    state = {key: template}
    _load(state, directory, storage_options, allow_partial=True)
    return state[key]


def _restore_tuples(optimizer: torch.optim.Optimizer) -> None:
    """DCP gives back a param group's tuples (Adam's betas) as lists: make them tuples again, so
    that a resumed run's optimizer (and its next checkpoint) is the uninterrupted run's."""
    defaults = optimizer.defaults
    for group in optimizer.param_groups:
        for key, value in group.items():
            if isinstance(value, list) and isinstance(defaults.get(key), tuple):
                group[key] = tuple(value)


def _load(state: dict[str, Any], directory: str, storage_options: Mapping[str, Any] | None,
          *, allow_partial: bool, strict: str | None = None) -> None:
    """DCP's load of ``state`` from ``directory``, safely; ``strict``: a key of ``state`` whose
    entries must be exactly the checkpoint's (as :func:`~cadence.torch.checkpoint_io.state.load_model_safetensors`)."""
    reader = _reader(directory, storage_options)
    try:
        with warnings.catch_warnings():  # no process group: one process, as asked (DCP warns of it)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(allow_partial_load=allow_partial, strict=strict),
                     no_dist=not _distributed())
    except UnsafeCheckpointError:
        raise
    except SaveError as e:  # DCP wraps every rank's failure into a CheckpointException
        # DCP turns a failed read of the metadata into an AssertionError naming it: the reader kept it.
        unsafe = _find(e, UnsafeCheckpointError) or reader.unsafe
        if unsafe is not None:
            raise unsafe from None
        mismatch = _find(e, CheckpointMismatchError)
        if mismatch is not None:
            raise CheckpointMismatchError(f"{directory}: {mismatch}") from None
        raise CheckpointError(f"{directory}: cannot load the sharded checkpoint: {describe(e)}") from e


def _distributed() -> bool:
    """A process group is up: loads are collectives over it (else: one process, no_dist)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _failures(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """The exceptions behind ``error``: those of each rank for DCP's ``CheckpointException``."""
    failures = getattr(error, "failures", None)  # {rank: exception, or DCP's wrapper of one}
    if not isinstance(failures, Mapping):
        return [(None, error)]
    found: list[tuple[int | None, BaseException]] = []
    for rank, failure in sorted(failures.items()):
        if isinstance(failure, tuple) and failure:  # DCP's (exception, traceback summary)
            failure = failure[0]
        exception = getattr(failure, "exception", failure)
        found.append((rank, exception if isinstance(exception, BaseException) else RuntimeError(str(exception))))
    return found


def _find(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    for _, failure in _failures(error):
        seen: BaseException | None = failure
        while seen is not None:
            if isinstance(seen, kind):
                return seen
            seen = seen.__cause__
    return None


def own_failure(error: BaseException, rank: int) -> str:
    """What of a failed collective DCP save was ``rank``'s own failure (:func:`describe`'s form,
    without the rank); ``""`` when another rank failed and this one only heard of it."""
    failures = _failures(error)
    if all(r is None for r, _ in failures):
        return describe(error)
    return "; ".join(_line(failure) for r, failure in failures if r == rank)


def _line(failure: BaseException) -> str:
    lines = str(failure).strip().splitlines()
    return f"{type(failure).__name__}: {lines[0]}" if lines else type(failure).__name__


def describe(error: BaseException) -> str:
    """One line for a failed DCP save or load: each failed rank's error (the first line of each)."""
    return "; ".join(_line(failure) if rank is None else f"rank {rank}: {_line(failure)}"
                     for rank, failure in _failures(error))


# -- safe reading -------------------------------------------------------------------------------

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own metadata classes, torch sizes, dtypes and layouts,
    paths; anything else raises :class:`UnsafeCheckpointError`."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _METADATA_MODULE and "." not in name:  # a dotted name reaches what the module imports
            found = getattr(sys.modules.get(module), name, None)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:  # its classes only
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: {METADATA_FILE} refers to {module}.{name}, which is not part of DCP's metadata; "
            "not unpickled (it could run arbitrary code)"
        )


class _SafeMetadata:
    """``read_metadata`` through :class:`_MetadataUnpickler` (mixed into DCP's readers)."""

    path: Any
    fs: Any
    load_id: str
    unsafe: UnsafeCheckpointError | None = None
    """The refusal of the last read (DCP's load turns it into an AssertionError of its own)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, METADATA_FILE)
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, str(path)).load()
            except UnsafeCheckpointError as e:
                self.unsafe = e
                raise
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _LocalReader(_SafeMetadata, FileSystemReader):
    pass


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a non-tensor value (the optimizer's hyper-parameters,
    the scheduler's state) is first unpickled with ``torch.load(weights_only=True)``: only a value
    that passes is handed on to DCP's own (unrestricted) loading. ``strict``: the top-level key
    (``"model"``) whose entries must be the checkpoint's, no more, no fewer (a partial load skips
    what the checkpoint lacks: a model's extra layers would keep their initial weights)."""

    def __init__(self, *args: Any, strict: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strict = strict

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.strict is None or metadata is None:
            return
        prefix = f"{self.strict}."
        wanted = {key: value for key, value in self.state_dict.items() if key.startswith(prefix)}
        saved = {key: item for key, item in metadata.state_dict_metadata.items() if key.startswith(prefix)}
        mismatch = describe_key_mismatch((key[len(prefix):] for key in wanted.keys() - saved.keys()),
                                         (key[len(prefix):] for key in saved.keys() - wanted.keys()))
        if not mismatch:  # a DTensor's shape is the whole tensor's, as the metadata's size
            mismatch = describe_shape_mismatch(
                {key[len(prefix):]: SimpleNamespace(shape=item.size) for key, item in saved.items()
                 if isinstance(item, TensorStorageMetadata)},
                {key[len(prefix):]: value for key, value in wanted.items() if isinstance(value, torch.Tensor)})
        if mismatch:  # bad input: the config builds another model; nothing is read
            raise CheckpointMismatchError(f"the {self.strict} state does not match this model: {mismatch}")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"the sharded checkpoint's value {read_item.dest_index.fqn!r} needs unsafe unpickling: {e}"
            ) from e
        value.seek(0)
        super().load_bytes(read_item, value)


def _reader(directory: str, storage_options: Mapping[str, Any] | None) -> Any:
    local = local_path(directory)
    if local is None:
        return _fsspec_reader(directory, storage_options)
    return _LocalReader(local)


def _fsspec_reader(directory: str, storage_options: Mapping[str, Any] | None) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _Reader(_SafeMetadata, FsspecReader):
        pass

    return _Reader(directory, **dict(storage_options or {}))


# -- writing ------------------------------------------------------------------------------------


class _Recording:
    """Mixed into DCP's writers: remembers the files this rank wrote."""

    written: list[str]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)  # type: ignore[misc]
        for result in future.wait():  # DCP's file writers are done when write_data returns
            name = result.storage_data.relative_path
            if name not in self.written:
                self.written.append(name)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # type: ignore[misc]
        self.written.append(METADATA_FILE)


class _LocalWriter(_Recording, FileSystemWriter):
    pass


def _writer(directory: str, storage_options: Mapping[str, Any] | None) -> Any:
    options: dict[str, Any] = {"single_file_per_rank": True, "sync_files": True, "overwrite": False}
    local = local_path(directory)
    if local is None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        class _FsspecWriter(_Recording, FsspecWriter):
            pass

        writer: Any = _FsspecWriter(directory, **options, **dict(storage_options or {}))
    else:
        writer = _LocalWriter(local, **options)
    writer.written = []
    return writer


SaveError: tuple[type[BaseException], ...] = (Exception, CheckpointException)
"""What a failed DCP save raises (its ``CheckpointException`` is a ``BaseException``)."""


def write_shards(state: Mapping[str, Any], directory: str, *, process_group: Any = None,
                 algorithm: str = checksum_lib.DEFAULT_ALGORITHM,
                 storage_options: Mapping[str, Any] | None = None) -> dict[str, tuple[int, str]]:
    """Collective (over ``process_group``; default: the default group): every rank writes its
    shards of ``state`` into ``directory`` (rank 0 also DCP's ``.metadata``), fsynced. Returns
    ``{name: (size, hex checksum of algorithm)}`` of the files this rank wrote, read back once
    to checksum them (from the page cache, just written)."""
    writer = _writer(directory, storage_options)
    dcp.save(dict(state), storage_writer=writer, process_group=process_group)
    storage = Storage(directory, dict(storage_options or {}))
    files = {}
    for name in writer.written:
        data = storage.read_view(storage.join(name), follow_link=False)
        files[name] = (len(data), checksum_lib.checksum_of(algorithm, data))
        data.release()
    return files


def stage(state: Mapping[str, Any], reuse: Any = None) -> tuple[dict[str, Any], Any]:
    """A CPU copy of ``state`` for an asynchronous save, and the stager holding its memory: pass
    it back as ``reuse`` to copy into the same memory next time (DCP's stager keeps the CPU
    storages; pinned memory and a blocking device-to-host copy for CUDA state)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if reuse is None:
        cuda = torch.cuda.is_available()
        reuse = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                             use_async_staging=False, use_non_blocking_copy=cuda))
    return reusable(reuse).stage(dict(state)), reuse


def reusable(stager: Any) -> Any:
    """``stager`` (DCP's ``DefaultStager``), ready for its next ``stage``: its deep-copy table as it was
    built, with an entry for classes. Call it before each ``stage``. With torch 2.11 (seen on CUDA, on an
    H100 and an H200) a stager's table was empty after each ``stage``: the next one failed with
    ``KeyError: <class 'type'>`` on the first object it rebuilt from its reduction (an FSDP2 state).
    Torch 2.13's keeps its table; this then changes nothing."""
    inner: Any = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    if inner is None or not isinstance(table, dict):
        return stager
    built = getattr(inner, "_cadence_built_table", None)
    if built is None:
        built = {type: copy._deepcopy_atomic, **table}  # type: ignore[attr-defined]
        inner._cadence_built_table = built
    for kind, copier in built.items():
        table.setdefault(kind, copier)
    return stager
