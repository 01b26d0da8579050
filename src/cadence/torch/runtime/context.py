"""Where a task runs: the device, the process's place among ranks, and the base seed.

In a multi-process job (started by torchrun, or ``cadence train --nproc N``) the context also
carries what a task needs to take part: the coordinator for collectives, and helpers to wrap the
model for data-parallel training (DDP), shard a dataset, build the loaders, gather objects
across ranks and build a dataset once for all ranks (:meth:`Context.cache_dataset`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset

from cadence.runtime.coordination import Coordinator, GathersToOne, LocalCoordinator
from cadence.errors import ConfigError
from cadence.storage import Storage
from cadence.runtime.watchdog import Heartbeat

log = logging.getLogger(__name__)

T = TypeVar("T")

CACHE_DIR_ENV = "CADENCE_CACHE_DIR"
"""Environment variable: the root of :meth:`Context.cache_dataset`'s cache (default
``~/.cache/cadence/datasets``)."""


def _default_device() -> torch.device:
    return torch.device("cpu")


def default_cache_dir() -> Path:
    """``$CADENCE_CACHE_DIR``, else ``~/.cache/cadence/datasets``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "cadence" / "datasets").expanduser()


@dataclasses.dataclass
class Context:
    """Handed to :meth:`Task.build_inputs` (and available to the task): where and as which rank
    this process runs.

    ``rank`` is the global rank among ``world_size`` processes, ``local_rank`` the rank on this
    machine (which GPU). Single-process runs use the defaults. ``coordinator`` runs the
    collectives (:meth:`gather`, :meth:`allgather`, :meth:`broadcast`, :meth:`barrier`); a
    single process gets a :class:`~cadence.runtime.coordination.LocalCoordinator`, a multi-process one
    the ``TorchCoordinator`` of the initialised process group (:meth:`create` sets it up).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=_default_device)
    seed: int = 0
    coordinator: Coordinator | None = dataclasses.field(default=None, repr=False, compare=False)
    heartbeat: Heartbeat | None = dataclasses.field(default=None, repr=False, compare=False)
    """Beaten by the trainer at each step and the evaluator at each batch, for the run's watchdog
    (``trainer.hang_timeout``; see :mod:`cadence.runtime.watchdog`). None: no watchdog."""
    mesh: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The run's ``DeviceMesh`` (dimensions ``dp_replicate``, ``dp_shard``, ``tp``, and ``dp`` flattened;
    :mod:`cadence.torch.parallel.mesh`), set by :meth:`use_mesh`; None for a single process."""
    dp_rank: int = -1
    """This rank's place among the data-parallel ranks (default: ``rank``): the ranks of one
    tensor-parallel group share it and read the same batches."""
    dp_size: int = -1
    """The number of data-parallel ranks (default: ``world_size``), over which the data is split."""
    replica_group: int = 0
    replica_groups: int = 1
    """Fault-tolerant replica groups (``trainer.fault_tolerance``): this process's group and their
    number; each group is a job of its own, and :meth:`data_shard` splits the data over all of them."""

    def data_shard(self) -> tuple[int, int]:
        """``(index, count)``: this rank's share of the data over every replica group's
        data-parallel ranks; ``(dp_rank, dp_size)`` without replica groups."""
        return self.replica_group * self.dp_size + self.dp_rank, self.replica_groups * self.dp_size

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.dp_size == -1:
            self.dp_rank, self.dp_size = self.rank, self.world_size
        if self.dp_size < 1 or self.world_size % self.dp_size or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} of dp_size {self.dp_size} does not fit world_size {self.world_size}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.coordinator is None:
            if self.world_size == 1:
                self.coordinator = LocalCoordinator()
            else:
                from cadence.torch.runtime.distributed import current_coordinator

                coord = current_coordinator()
                if coord is not None and (coord.rank, coord.world_size) == (self.rank, self.world_size):
                    self.coordinator = coord
        elif (self.coordinator.rank, self.coordinator.world_size) != (self.rank, self.world_size):
            raise ValueError(
                f"the coordinator is rank {self.coordinator.rank} of {self.coordinator.world_size}, "
                f"the context rank {self.rank} of {self.world_size}"
            )

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the process that writes checkpoints and summaries."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    def use_mesh(self, mesh: Any, dp_rank: int, dp_size: int) -> None:
        """Set the run's device mesh and this rank's data-parallel coordinates (the data helpers
        then split the data over the ``dp_size`` data-parallel ranks, not over every rank)."""
        if dp_size < 1 or self.world_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} of dp_size {dp_size} does not fit world_size {self.world_size}")
        self.mesh, self.dp_rank, self.dp_size = mesh, dp_rank, dp_size

    @classmethod
    def create(
        cls,
        device: str | torch.device = "auto",
        seed: int = 0,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        backend: str = "auto",
        timeout_s: float = 120.0,
    ) -> Context:
        """A context on ``device`` for this process.

        With neither ``rank`` nor ``world_size`` given, the place comes from the environment:
        under torchrun (``WORLD_SIZE`` > 1) this initialises ``torch.distributed``
        (:func:`cadence.torch.runtime.distributed.init_distributed`, idempotent) and the context gets
        its rank, world size, local rank and coordinator; otherwise a single process.
        Given explicitly, they are used as they are and nothing is initialised.

        ``device``: ``"auto"`` picks ``cuda:<local_rank>`` when CUDA is available, else CPU;
        ``"cuda"`` without an index means ``cuda:<local_rank>``. ``backend``: the process
        group's; ``"auto"``: nccl for a CUDA device, else gloo. ``timeout_s``: of collectives.
        """
        from cadence.torch.runtime.distributed import current_coordinator, init_distributed, rank_env

        coordinator: Coordinator | None = None
        if rank is None and world_size is None:
            env_local = rank_env()[2]
            if backend == "auto" and not (isinstance(device, str) and device == "auto"):
                backend = "nccl" if _is_cuda(device) else "gloo"  # "auto" device: init_distributed decides
            coordinator = init_distributed(backend=backend, timeout_s=timeout_s)
            if coordinator is not None:
                rank, world_size = coordinator.rank, coordinator.world_size
                local_rank = env_local if local_rank is None else local_rank
            else:
                rank, world_size = 0, 1
                local_rank = 0 if local_rank is None else local_rank
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
            local_rank = 0 if local_rank is None else local_rank
            if world_size > 1:
                coordinator = current_coordinator()
        n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if isinstance(device, str) and device == "auto":
            device = torch.device("cuda", local_rank % n_cuda) if n_cuda else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank % max(n_cuda, 1))
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device, seed=seed,
                   coordinator=coordinator)

    # -- model and data ------------------------------------------------------------------------

    def per_rank_batch(self, global_batch_size: int, *, name: str = "global batch size") -> int:
        """This rank's batch size for a *global* batch of ``global_batch_size`` samples per
        (micro)batch step: ``global_batch_size // dp_size`` (the data-parallel ranks; without tensor
        parallelism every rank).

        Use it in :meth:`Task.build_inputs` so that a config states the global batch and the run
        sees the same number of samples per step on any number of processes (as torchtitan's
        ``global_batch_size``): ``cadence train config.yaml --nproc 2`` then trains on the same
        global batches as one process (with :class:`~cadence.torch.ResumableLoader`, ``drop_last=True``).
        ``name`` names the setting in the error, e.g. ``"task.params.global_batch_size"``.

        Raises :class:`~cadence.errors.ConfigError` (one line; exit status 2 from the CLI) when
        ``global_batch_size`` is not an integer >= 1 or does not divide by the data-parallel size.
        """
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, got {global_batch_size!r}")
        n = self.dp_size
        if global_batch_size % n:
            lower = global_batch_size - global_batch_size % n
            higher = lower + n
            choices = f"{lower} or {higher}" if lower else str(higher)
            what = f"the world size {n} (processes)" if n == self.world_size else f"the data-parallel size {n}"
            raise ConfigError(f"{name}: {global_batch_size} does not divide by {what}: use a multiple of {n}, e.g. {choices}")
        return global_batch_size // n

    def wrap_model(self, model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
        """The model for training: ``DistributedDataParallel`` over it when ``world_size`` > 1
        (``device_ids=[device]`` on CUDA), the model itself otherwise.

        Moves the model to :attr:`device` first. DDP broadcasts rank 0's parameters and buffers
        to the others when it wraps (a collective: every rank wraps at the same point). Extra
        keywords go to DDP (e.g. ``find_unused_parameters=True``). A model already wrapped is
        returned as it is.
        """
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        self.require_process_group("wrap_model")
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
            ddp_kwargs.setdefault("output_device", self.device.index)
        return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)

    def wrap_dataset(self, dataset: Any, shard: bool = True) -> Any:
        """This rank's part of a map-style dataset: the samples ``dp_rank, dp_rank + W, dp_rank + 2W, ...``
        (``W``: ``dp_size``; the ranks of a tensor-parallel group get the same part).

        No padding and no duplicates: with ``len(dataset) % W != 0`` the first ranks get one
        sample more; together the ranks see every sample exactly once (what evaluation needs).
        ``shard=False``, or a single process: ``dataset`` unchanged. Raises ``TypeError`` for an
        iterable-style dataset (shard it yourself with :attr:`rank` / :attr:`world_size`).
        """
        if not shard or self.dp_size == 1:
            return dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"wrap_dataset needs a map-style dataset (with __len__ and __getitem__), got "
                f"{type(dataset).__name__}; shard an iterable dataset yourself with ctx.rank / ctx.world_size"
            )
        return Subset(dataset, range(self.dp_rank, len(dataset), self.dp_size))

    def loader(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int | None = None,
        train: bool = True,
        **kwargs: Any,
    ) -> Any:
        """A loader for this rank.

        ``train=True``: a :class:`~cadence.torch.ResumableLoader` over the whole dataset, rank
        ``dp_rank`` of ``dp_size`` (:meth:`data_shard`: over every replica group's ranks; its position,
        in global samples, is checkpointed; a resume on another world size continues the same global
        order); ``shuffle`` defaults to True and
        ``drop_last`` to more than one shard (every rank then yields the same number of batches,
        which DDP needs). ``train=False``: a plain ``DataLoader`` over :meth:`wrap_dataset`
        (unpadded shards: per-rank metric states merge to the single-process value); ``shuffle``
        defaults to False. ``seed`` defaults to :attr:`seed`. ``batch_size`` is per rank. Extra
        keywords go to the loader.
        """
        seed = self.seed if seed is None else int(seed)
        if train:
            from cadence.torch.data.loaders import ResumableLoader

            index, count = self.data_shard()
            kwargs.setdefault("drop_last", count > 1)
            return ResumableLoader(dataset, batch_size, shuffle=True if shuffle is None else shuffle, seed=seed,
                                   rank=index, world_size=count, **kwargs)
        if shuffle and "generator" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        return DataLoader(self.wrap_dataset(dataset), batch_size=batch_size, shuffle=bool(shuffle), **kwargs)

    # -- collectives ---------------------------------------------------------------------------

    def require_process_group(self, what: str) -> None:
        """``RuntimeError`` naming ``what`` when ``torch.distributed`` is not initialised (for a
        multi-process context: DDP and FSDP need the process group)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                f"{what}: world_size is {self.world_size} but torch.distributed is not initialised "
                "(create the context with Context.create() under torchrun)"
            )

    def _coord(self, what: str) -> Coordinator:
        if self.coordinator is None:
            raise RuntimeError(
                f"{what}: world_size is {self.world_size} but the context has no coordinator "
                "(torch.distributed not initialised; create the context with Context.create() under torchrun)"
            )
        return self.coordinator

    def barrier(self) -> None:
        """Return when every rank has called it (collective)."""
        self._coord("barrier").barrier()

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank ``dst``; ``None`` elsewhere (collective)."""
        coord = self._coord("gather")
        if isinstance(coord, GathersToOne):
            return coord.gather(obj, dst=dst)
        out = coord.all_gather(obj)
        return out if self.rank == dst else None

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (collective)."""
        return self._coord("allgather").all_gather(obj)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (picklable) on every rank (collective)."""
        return self._coord("broadcast").broadcast(obj, src=src)

    # -- dataset cache -------------------------------------------------------------------------

    def cache_dataset(
        self, dataset_id: str, version: str, cache_dir: str | os.PathLike[str] | None = None
    ) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Decorate a zero-argument function that builds a dataset: build it once, on rank 0.

        ::

            @ctx.cache_dataset("digits", "v1")
            def build():
                return {"x": torch.randn(1000, 8), "y": torch.randint(0, 2, (1000,))}

            data = build()   # the same value on every rank

        The first call (on every rank: a collective) makes rank 0 build the value and save it
        atomically to ``<cache_dir>/<dataset_id>/<version>/data.pt`` while the other ranks wait,
        then every rank loads it. When the file is already there (a later run) nobody builds.
        ``cache_dir``: default ``$CADENCE_CACHE_DIR``, else ``~/.cache/cadence/datasets``; a rank
        that cannot see rank 0's file (a cache dir local to each machine) gets its bytes from
        rank 0 and stores them in its own cache. Bump ``version`` when the building changes.

        The value must be made of tensors, numpy arrays (numeric or bool) and scalars, Python
        scalars (``None``, bool, int, float, complex, str, bytes), lists, tuples and dicts of
        them: it is saved with ``torch.save`` and loaded only with
        ``torch.load(weights_only=True)``, never arbitrary unpickling. Anything else raises
        ``TypeError`` (on every rank), naming where in the value it is.
        """
        _check_name(dataset_id, "dataset_id")
        _check_name(version, "version")
        root = Path(cache_dir).expanduser() if cache_dir is not None else None

        def decorator(fn: Callable[[], Any]) -> Callable[[], Any]:
            @functools.wraps(fn)
            def cached() -> Any:
                path = (root or default_cache_dir()) / dataset_id / version / "data.pt"
                return self._cached(fn, path, f"cache_dataset({dataset_id!r}, {version!r})")

            return cached

        return decorator

    def _cached(self, fn: Callable[[], Any], path: Path, what: str) -> Any:
        coord = self._coord(what) if self.world_size > 1 else (self.coordinator or LocalCoordinator())
        failure: tuple[str, str] | None = None
        error: BaseException | None = None
        if self.is_chief and not path.is_file():
            try:
                log.info("%s: building it (%s)", what, path)
                payload = _encode(fn(), "value")
                _atomic_write(path, lambda f: torch.save(payload, f))
            except Exception as e:  # told to the other ranks before raising
                error = e
                failure = (type(e).__name__, f"{what}: rank 0 failed to build it: {type(e).__name__}: {e}")
        if self.world_size > 1:
            # Doubles as the barrier: the other ranks wait here while rank 0 builds.
            failure = coord.broadcast(failure, src=0)
        if error is not None:
            raise error
        if failure is not None:
            raise (TypeError if failure[0] == "TypeError" else RuntimeError)(failure[1])
        missing = not path.is_file()
        if self.world_size > 1 and coord.any(missing):
            if missing:  # e.g. a cache dir local to each machine
                log.warning("%s: rank 0's file is not visible here (%s): rank 0 sends it", what, path)
            data = coord.broadcast(path.read_bytes() if self.is_chief else None, src=0)
            if missing:
                _atomic_write(path, lambda f: f.write(data))
        try:
            loaded = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:
            raise RuntimeError(
                f"{what}: cannot load {path} with torch.load(weights_only=True): {type(e).__name__}: "
                f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}; delete it to rebuild"
            ) from e
        return _decode(loaded)


def _is_cuda(device: str | torch.device) -> bool:
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value in (".", ".."):
        raise ValueError(
            f"cache_dataset: {what} must be a non-empty name of letters, digits and . _ + = - "
            f"(one path component), got {value!r}"
        )


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Create ``path``'s directory, then replace ``path`` all at once by what ``write(stream)`` writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    storage = Storage(str(path))
    with storage.open_atomic(storage.root) as f:
        write(f)


# -- what cache_dataset may store ------------------------------------------------------------------

_NDARRAY = "__cadence_ndarray__"
_NPSCALAR = "__cadence_numpy_scalar__"
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _numpy_to_tensor(a: np.ndarray, where: str) -> torch.Tensor:
    a = np.array(a, copy=True, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(a)
    except TypeError:
        raise TypeError(
            f"cache_dataset: {where} is a numpy array of dtype {a.dtype}, which cannot be stored "
            "as a tensor (only numeric and bool dtypes)"
        ) from None


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return {_NDARRAY: _numpy_to_tensor(value, where)}
    if isinstance(value, np.generic):
        return {_NPSCALAR: _numpy_to_tensor(np.asarray(value), where)}
    if type(value) in _SCALARS:
        return value
    if type(value) in (list, tuple):
        out = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return out if type(value) is list else tuple(out)
    if type(value) in (dict, OrderedDict):
        out_d = {}
        for k, v in value.items():
            if type(k) not in _SCALARS:
                raise TypeError(f"cache_dataset: {where} has a key of type {type(k).__name__}; keys must be scalars")
            out_d[k] = _encode(v, f"{where}[{k!r}]")
        return out_d
    raise TypeError(
        f"cache_dataset: {where} is a {type(value).__module__}.{type(value).__qualname__}; the cached value "
        "must be tensors, numpy arrays, Python scalars, and lists / tuples / dicts of them (it is loaded "
        "with torch.load(weights_only=True)); return the tensors and build the dataset from them after loading"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _NDARRAY in value:
            return value[_NDARRAY].numpy()
        if len(value) == 1 and _NPSCALAR in value:
            return value[_NPSCALAR].numpy()[()]
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_decode(v) for v in value)
    return value
