"""torch.distributed for cadence: starting the process group and the coordinator that makes all
ranks agree.

A multi-process job is started by torch's launcher (``torchrun``, or ``cadence train --nproc N``,
which runs it), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in every worker; :func:`init_distributed` reads them and initialises the
default process group. Without them (or with ``WORLD_SIZE=1``) the process runs alone. A task of
a Slurm step of several tasks (``srun --ntasks N cadence train ...``) without them gets them from
Slurm's environment (:mod:`cadence.cluster.slurm`).

Control-plane collectives (agree to stop, save, roll back; gather small objects) run on a gloo
process group, so they work whatever the data-plane backend is (nccl on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from typing import Any, Mapping, TypeVar

import torch
import torch.distributed as dist

from cadence.cluster import slurm
from cadence.errors import ConfigError
from cadence.torch.runtime import heartbeat

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = [
    "TorchCoordinator",
    "broadcast_unsharded",
    "current_coordinator",
    "init_distributed",
    "rank_env",
    "shutdown_distributed",
]

_ENV_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What a rank of a job of several processes needs besides ``WORLD_SIZE``. ``LOCAL_RANK`` may be missing: a
launcher that starts one process per machine (Kubernetes' PyTorchJob sets ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE`` and ``RANK`` only) gets local rank 0."""


class TorchCoordinator:
    """:class:`cadence.runtime.coordination.Coordinator` on ``torch.distributed`` (already initialised).

    ``group``: the process group for control collectives; default: the default group when it is
    gloo, else one gloo group over all ranks shared by all coordinators (created collectively on
    first use: every rank must construct its coordinator at the same point). ``timeout_s``: the
    timeout of that gloo group (default: torch's).

    A coordinator holds no reference to a group it did not get as ``group``: after
    :func:`shutdown_distributed` the groups are really destroyed, not kept alive until the
    interpreter exits (a gloo group torn down at exit can abort the process).
    """

    def __init__(self, group: Any | None = None, *, timeout_s: float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCoordinator needs torch.distributed to be initialised first")
        self._group = group
        self._control = group is None and dist.get_backend() != "gloo"
        if self._control:
            _control_group(timeout_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @property
    def group(self) -> Any | None:
        """The group the collectives run on (``None``: the default group)."""
        if self._control:
            if _CONTROL["group"] is None:
                raise RuntimeError("the coordinator's process group was destroyed (shutdown_distributed)")
            return _CONTROL["group"]
        return self._group

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast(self, obj: T, src: int = 0) -> T:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; ``None`` on the others (collective)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out


# -- the process group ---------------------------------------------------------------------------

_coordinator: TorchCoordinator | None = None
_CONTROL: dict[str, Any] = {"group": None}  # the gloo group for control collectives under nccl


def _control_group(timeout_s: float | None) -> Any:
    if _CONTROL["group"] is None:
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        _CONTROL["group"] = dist.new_group(backend="gloo", timeout=timeout)
    return _CONTROL["group"]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def rank_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; for a task
    of a Slurm step without them, from Slurm's variables (:func:`cadence.cluster.slurm.torchrun_env`).

    Unset variables read as a single process: ``(0, 1, 0)``. Raises ``ValueError`` for values
    that are not integers or out of range.
    """
    env = os.environ if environ is None else environ
    env = {**env, **slurm.torchrun_env(env)}
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size}: must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank}: must be in [0, WORLD_SIZE={world_size})")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank}: must be >= 0")
    return rank, world_size, local_rank


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"``: ``nccl`` when CUDA is available, else ``gloo``; anything else is returned as is."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def current_coordinator() -> TorchCoordinator | None:
    """The coordinator of the initialised process group (made on first call), or ``None`` when
    ``torch.distributed`` is not initialised. Collective on its first call when the default group
    is not gloo (it creates the gloo control group)."""
    global _coordinator
    if not dist.is_available() or not dist.is_initialized():
        _coordinator = None
        return None
    if _coordinator is None:
        _coordinator = TorchCoordinator()
    return _coordinator


def init_distributed(backend: str = "auto", timeout_s: float = 120.0) -> TorchCoordinator | None:
    """Initialise the default process group from torchrun's environment; return its coordinator.

    With ``WORLD_SIZE`` > 1 (and ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    set, as torchrun does; a task of a Slurm step gets them from Slurm's, exported into this
    process's environment), sets the CUDA device to ``LOCAL_RANK`` when the backend is nccl (or
    ``auto`` with CUDA available), initialises the default group with ``env://`` and a timeout of
    ``timeout_s`` seconds for its collectives, and returns a :class:`TorchCoordinator`. Without
    that environment (or ``WORLD_SIZE=1``) returns ``None``: a single process.

    Idempotent: once the group is initialised (here or by the caller) it returns the same
    coordinator. Collective: every rank must call it.

    ``LOCAL_RANK`` unset (a launcher that starts one process per machine, e.g. Kubernetes' PyTorchJob)
    means local rank 0; it is then set to ``0`` in this process's environment, for whatever reads it.

    Raises:
      ConfigError: ``WORLD_SIZE`` > 1 but ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` is missing
        (one line: the CLI exits 2).
      RuntimeError: torch.distributed is not available in this build of torch.
    """
    if dist.is_available() and dist.is_initialized():
        return current_coordinator()
    slurm.export_torchrun_env()  # a task of a Slurm step: torchrun's variables, for env:// too
    rank, world_size, local_rank = rank_env()
    if world_size <= 1:
        return None
    missing = [name for name in _ENV_VARS if not os.environ.get(name, "").strip()]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; "
            "start the processes with torchrun (or `cadence train --nproc N`), which sets them"
        )
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this build of torch has no torch.distributed")
    if not os.environ.get("LOCAL_RANK", "").strip():  # one process per machine: PyTorchJob and the like
        os.environ["LOCAL_RANK"] = str(local_rank)
    backend = resolve_backend(backend)
    if "nccl" in backend:  # nccl needs each process on its own device before the group starts
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
    timeout = datetime.timedelta(seconds=timeout_s)
    log.debug("initialising torch.distributed: backend=%s rank=%d world_size=%d", backend, rank, world_size)
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timeout)
    global _coordinator
    _coordinator = TorchCoordinator(timeout_s=timeout_s)
    heartbeat.start()  # several nodes: which ranks are gone, when a collective fails
    return _coordinator


def broadcast_unsharded(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (a collective), so that every replica holds the
    same weights; a sharded (FSDP2 ``DTensor``) parameter exists once and is left alone. No-op
    without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.tensor import DTensor  # only where there are ranks (a costly import)

    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=0)


def shutdown_distributed(barrier: bool = False) -> None:
    """Destroy the default process group (no-op when none is initialised). Idempotent.

    ``barrier=True`` first waits for every rank (a collective): no rank then tears its
    connections down while another still talks to it -- call it so at the normal end of a job
    (``cadence train`` does), not after an error (the others may never arrive).
    """
    global _coordinator
    coord = _coordinator
    _coordinator = None
    if dist.is_available() and dist.is_initialized():
        if barrier:
            if coord is not None:
                coord.barrier()
            else:
                dist.barrier()
        _CONTROL["group"] = None
        # Objects that hold a group (a DDP model's reducer) and are garbage in a reference cycle
        # would keep it alive until the interpreter exits: free them first.
        gc.collect()
        dist.destroy_process_group()
    _CONTROL["group"] = None
