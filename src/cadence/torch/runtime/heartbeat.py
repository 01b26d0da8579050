"""Which ranks of a multi-node job are gone: each rank's heartbeat in the job's store.

When a node of a torchrun job is lost (its machine, or its agent and workers killed), the other
ranks' next collective fails with a transport error that names no rank ("Connection closed by
peer"). So in a job of several nodes (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``) every rank, once its
process group is up (:func:`start`), publishes in the default group's store which node it runs on
(``$CADENCE_NODE_RANK``, the ``--node-rank`` cadence was given, else torch's ``GROUP_RANK``) and its
host, reads every rank's, and then adds 1 to its key ``cadence/alive/<rank>`` every
:data:`HEARTBEAT_S`. A rank whose collective failed asks :func:`silent_ranks`: the ranks whose count
stood still for :data:`SILENT_S`, but for those that said they are ending on an error
(:func:`mark_ended`: they failed, or saw a peer fail; their own node reports them). When the store
itself no longer answers, the ranks of the node hosting it (rank 0's, whose process serves it) are
the ones lost.

The heartbeat runs until this process exits (also after an error: a rank still alive must keep
answering while the others look), and holds the store, so rank 0 keeps serving it meanwhile.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["HEARTBEAT_S", "NODE_RANK_ENV", "SILENT_S", "RankPlace", "mark_ended", "silent_ranks", "start",
           "this_rank"]

HEARTBEAT_S = 0.25
"""How often each rank adds to its heartbeat count."""

SILENT_S = 2.0
"""How long a rank's count must stand still for the rank to count as gone."""

NODE_RANK_ENV = "CADENCE_NODE_RANK"
"""The ``--node-rank`` that ``cadence train`` was given on this node (torch's c10d rendezvous assigns
its own ``GROUP_RANK``)."""

_ALIVE = "cadence/alive/"
_PLACE = "cadence/place/"
_ENDED = "cadence/ended/"
_STORE_TIMEOUT = datetime.timedelta(seconds=5)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its node (as the user numbered it) and host."""

    rank: int
    node: str
    host: str


class _Heartbeat:
    def __init__(self, store: Any, rank: int, places: dict[int, RankPlace]) -> None:
        self.store, self.rank, self.places = store, rank, places
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cadence-heartbeat", daemon=True)

    def _run(self) -> None:
        key = f"{_ALIVE}{self.rank}"
        while not self.stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store's host is gone: nothing to answer to any more
                return
            self.stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2 * HEARTBEAT_S)


_HEARTBEAT: dict[str, _Heartbeat | None] = {"current": None}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def start() -> None:
    """In a rank of a multi-node job with its default process group up: publish where this rank
    runs, learn where every rank runs, and start the heartbeat (once per process). Every rank must
    call it (it waits for every rank's place). No-op in a one-node job."""
    if _HEARTBEAT["current"] is not None or not (dist.is_available() and dist.is_initialized()):
        return
    world_size = dist.get_world_size()
    if world_size <= _env_int("LOCAL_WORLD_SIZE", world_size):
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank = dist.get_rank()
    node = os.environ.get(NODE_RANK_ENV) or os.environ.get("GROUP_RANK") or "?"
    store.set(f"{_PLACE}{rank}", json.dumps({"node": node, "host": socket.gethostname()}))
    keys = [f"{_PLACE}{r}" for r in range(world_size)]
    store.wait(keys)
    places = {}
    for r, raw in enumerate(store.multi_get(keys)):
        data = json.loads(bytes(raw).decode())
        places[r] = RankPlace(r, str(data["node"]), str(data["host"]))
    heartbeat = _Heartbeat(store, rank, places)
    _HEARTBEAT["current"] = heartbeat
    heartbeat.thread.start()
    atexit.register(heartbeat.close)  # before the interpreter's teardown: no thread left in a store call


def this_rank() -> RankPlace | None:
    """Where this rank runs; None without a heartbeat (not a rank of a multi-node job)."""
    heartbeat = _HEARTBEAT["current"]
    return None if heartbeat is None else heartbeat.places[heartbeat.rank]


def mark_ended() -> None:
    """Say in the store that this rank is ending on an error (best effort; no-op without a heartbeat):
    a rank that stops answering after this is not a lost one."""
    heartbeat = _HEARTBEAT["current"]
    if heartbeat is None:
        return
    try:
        heartbeat.store.set_timeout(_STORE_TIMEOUT)
        heartbeat.store.set(f"{_ENDED}{heartbeat.rank}", "1")
    except Exception:  # the store's host is gone
        pass


def silent_ranks(silent_s: float = SILENT_S) -> list[RankPlace]:
    """The other ranks whose heartbeat stood still for ``silent_s`` seconds (this call waits that
    long) and that did not say they were ending (:func:`mark_ended`), in rank order; when the store
    does not answer, the ranks of the node that hosts it. [] without a heartbeat."""
    heartbeat = _HEARTBEAT["current"]
    if heartbeat is None:
        return []
    others = [r for r in sorted(heartbeat.places) if r != heartbeat.rank]
    try:
        heartbeat.store.set_timeout(_STORE_TIMEOUT)
        before = [heartbeat.store.add(f"{_ALIVE}{r}", 0) for r in others]
        time.sleep(silent_s)
        after = [heartbeat.store.add(f"{_ALIVE}{r}", 0) for r in others]
        ended = {r for r in others if heartbeat.store.check([f"{_ENDED}{r}"])}
    except Exception:  # the store's host is gone: the node of rank 0, whose process served it
        host_node = heartbeat.places[0].node
        return [p for r, p in sorted(heartbeat.places.items()) if p.node == host_node and r != heartbeat.rank]
    return [heartbeat.places[r] for r, b, a in zip(others, before, after) if a == b and r not in ended]
