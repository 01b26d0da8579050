"""The torchft ``Manager`` of one rank of a replica group: the group's TCPStore (a group of one process
opens its own on 127.0.0.1, or ``MASTER_ADDR``; a group of several ranks shares its launcher's,
``MASTER_ADDR:MASTER_PORT``), a reconfigurable gloo process group joining this rank to the ranks of
equal group rank in the other groups, and, on the group's rank 0, the manager server that talks to
the lighthouse -- one :class:`~cadence.errors.ConfigError` line when it cannot be reached within
``connect_timeout_s``, before any step."""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

from cadence.config.components.fault_tolerance import LIGHTHOUSE_ENV, FaultToleranceConfig
from cadence.errors import ConfigError

__all__ = ["build_manager", "import_torchft", "reach_lighthouse"]


def import_torchft() -> Any:
    """The ``torchft`` module; a :class:`ConfigError` naming the ``ft`` extra when it is missing."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info
    try:
        import torchft
    except ImportError as exc:
        raise ConfigError(f"trainer.fault_tolerance needs torchft (pip install 'cadence[ft]'): {exc}") from None
    return torchft


def lighthouse_address(config: FaultToleranceConfig) -> str:
    """``config.lighthouse``, else ``TORCHFT_LIGHTHOUSE``; a :class:`ConfigError` when neither is set."""
    address = config.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ConfigError(f"trainer.fault_tolerance: no lighthouse address (set trainer.fault_tolerance.lighthouse "
                          f"or {LIGHTHOUSE_ENV}, or start the groups with cadence launch --replicas)")
    return address


def reach_lighthouse(address: str, timeout_s: float) -> None:
    """Wait until the lighthouse at ``address`` (``http://host:port``) accepts a TCP connection; a
    :class:`ConfigError` after ``timeout_s``. Every rank of a group checks (before anything is built),
    so that all of them end with the same line: only the group's rank 0 talks to the lighthouse, and
    without the check the other ranks would fail on the store rank 0 took down with it."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                reason = exc.strerror or type(exc).__name__
                raise ConfigError(f"trainer.fault_tolerance: cannot reach the lighthouse at {address} within "
                                  f"{timeout_s:g} s ({reason})") from None
            time.sleep(0.1)


def build_manager(config: FaultToleranceConfig, replica_id: int,
                  state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], *,
                  rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """A ``torchft.Manager`` for rank ``rank`` of the ``world_size`` ranks of group ``replica_id``, with
    the healing callbacks, the quorum taken synchronously at each step's start (a healing group loads
    the peer's state before its forward pass and takes part in that step), and ``min_replica_size =
    config.min_replicas``; with the TCPStore this process opened (None for a group of several ranks,
    whose store is its launcher's), which must live as long as the manager."""
    torchft = import_torchft()
    from torch.distributed import TCPStore

    # torchft warns at every new quorum that NCCL's flight recorder cannot be reset: nothing to do on gloo
    logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())
    # a healing rank's transfer is read from a bytes buffer (torch's streaming load): its tensors are copied
    # into this rank's own (healing.load_healing_state), so torch's warning that it is read-only says nothing
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

    address = lighthouse_address(config)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if world_size > 1:  # the group's launcher's store (torchrun's), which every rank of the group reaches
        if not os.environ.get("MASTER_PORT", "").strip().isdigit():
            raise ConfigError("trainer.fault_tolerance: a replica group of several ranks shares its launcher's store "
                              "at MASTER_ADDR:MASTER_PORT; MASTER_PORT is not set (start the group with torchrun or "
                              "cadence train --nproc)")
        store, port = None, int(os.environ["MASTER_PORT"])
    else:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this group's own (one process)
        port = store.port
    timeout = timedelta(seconds=config.timeout_s)
    try:
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=config.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s), rank=rank, world_size=world_size,
            store_addr=host, store_port=port, lighthouse_addr=address, replica_id=f"group_{replica_id}",
        )
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "failed to connect" in first:
            raise ConfigError(f"trainer.fault_tolerance: cannot reach the lighthouse at {address} within "
                              f"{config.connect_timeout_s:g} s ({first.split(': ')[-1]})") from None
        raise
    return manager, store
