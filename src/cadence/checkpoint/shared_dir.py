"""Whether every rank of a job sees the model dir the chief writes (docs/design.md, "Distributed").

The ranks of a job on several machines must share one model dir. Node-local disks mounted at the
same path on every machine are the classic silent failure: each node would resume from its own
checkpoints and write its own part of a sharded one. :func:`check_shared` catches it when a
training job starts, before anything is restored or trained, at the cost of one small read per
rank and two collectives:

1. the chief has just written its writer lease, ``.writer/lease-<token>.json``
   (:mod:`cadence.checkpoint.writer_lease`): a file no earlier run wrote, the token of this check.
   It sends the lease's identity (token, host, pid, pid namespace, acquisition time) to every rank
   (a broadcast);
2. every other rank reads that file back through :class:`~cadence.storage.Storage`, as checkpoints
   are read, and compares. A file not there (or not readable) yet is looked for again for up to
   ``wait_s`` seconds (a shared file system may show another machine's new file after a moment);
3. the ranks agree on what they saw (an all-gather): when any rank found no such file, another
   lease by that name or could not read it, every rank raises the same
   :class:`~cadence.errors.ModelDirNotSharedError` (exit 2) naming those ranks and their machines.

Nothing is written and nothing is left to clean up: the lease is the chief's anyway.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from cadence.checkpoint.writer_lease import WriterLeaseRecord, lease_path, read_lease
from cadence.errors import ModelDirNotSharedError, one_line
from cadence.runtime.coordination import Coordinator

__all__ = ["DEFAULT_WAIT_S", "check_shared", "place"]

logger = logging.getLogger("cadence.checkpoint")

DEFAULT_WAIT_S = 2.0
"""How long a rank looks for the chief's file before it reports not seeing it."""

NODE_ENV = ("CADENCE_NODE_RANK", "GROUP_RANK", "SLURM_NODEID")
"""Environment variables naming this process's node, first set wins: the ``--node-rank`` that
``cadence train`` was given (c10d's rendezvous numbers the nodes its own way), torchrun's, Slurm's."""

_IDENTITY = ("token", "host", "pid", "pid_namespace", "since")


def place() -> str:
    """This process's machine for a message: ``"node N, host H"`` (``"host H"`` when no launcher
    names the node, see :data:`NODE_ENV`)."""
    node = next((os.environ[name].strip() for name in NODE_ENV if os.environ.get(name, "").strip()), None)
    host = socket.gethostname() or "?"
    return f"node {node}, host {host}" if node is not None else f"host {host}"


def _identity(record: WriterLeaseRecord) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in _IDENTITY)


def _look(model_dir: str, expected: tuple[Any, ...], wait_s: float,
          storage_options: dict[str, Any] | None) -> tuple[str, str] | None:
    """None when this process sees the chief's lease file; else what it sees instead: ``(kind,
    detail)``, ``kind`` one of ``"missing"``, ``"other"`` (another lease by that name), ``"error"``."""
    token = expected[0]
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            record = read_lease(model_dir, token, storage_options=storage_options)
        except FileNotFoundError:
            problem = ("missing", "")
        except (OSError, ValueError) as e:
            problem = ("error", one_line(e, limit=200))
        else:
            if _identity(record) == expected:
                return None
            return "other", f"a lease of pid {record.pid} on host {record.host or '?'}"  # another file system
        if time.monotonic() + delay > deadline:
            return problem
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def check_shared(model_dir: str, coordinator: Coordinator, lease: WriterLeaseRecord | None, *,
                 storage_options: dict[str, Any] | None = None, wait_s: float = DEFAULT_WAIT_S) -> None:
    """Check that every rank sees the chief's writer lease file in ``model_dir`` (see the module
    doc); a collective: every rank of the job calls it, the chief with its ``lease`` (the other
    ranks' ``lease`` is ignored). Returns at once on a single process, and does nothing when the
    chief holds no lease (None).

    Raises:
      ModelDirNotSharedError: on every rank, when a rank does not see that file as the chief wrote it.
    """
    if coordinator.world_size <= 1:
        return
    started = time.monotonic()
    sent = (_identity(lease), place(), model_dir) if coordinator.is_chief and lease is not None else None
    sent = coordinator.broadcast(sent)
    if sent is None:
        return
    expected, chief_place, chief_dir = sent
    problem = None if coordinator.is_chief else _look(model_dir, expected, wait_s, storage_options)
    seen = coordinator.all_gather((place(), problem))
    failed = [(rank, where, tuple(saw)) for rank, (where, saw) in enumerate(seen) if saw is not None]
    if failed:  # the same message on every rank (the chief's model dir as it named it)
        raise ModelDirNotSharedError(_message(chief_dir, expected[0], chief_place, failed))
    logger.debug("every rank sees the model dir %s (%s; checked in %.3fs)", chief_dir, lease_path(expected[0]),
                 time.monotonic() - started)


_SAYS = {"missing": ("does not see it", "do not see it"),
         "other": ("finds another file by that name ({})", "find another file by that name ({})"),
         "error": ("cannot read it ({})", "cannot read it ({})")}


def _message(model_dir: str, token: int, chief_place: str, failed: list[tuple[int, str, tuple[str, str]]]) -> str:
    """One line: which ranks (grouped by machine and what they saw) miss the chief's file, and what to do."""
    groups: dict[tuple[str, tuple[str, str]], list[int]] = {}
    for rank, where, problem in failed:
        groups.setdefault((where, problem), []).append(rank)
    clauses = []
    for (where, (kind, detail)), ranks in groups.items():
        one, several = _SAYS.get(kind, _SAYS["error"])
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        clauses.append(f"{who} ({where}) {(one if len(ranks) == 1 else several).format(detail)}")
    return (f"model dir {model_dir} is not shared: rank 0 ({chief_place}) wrote {lease_path(token)} there, and "
            f"{'; '.join(clauses)}; every node must mount the same storage at that path "
            "(a shared file system or an object store URL)")


def _ranks(ranks: list[int]) -> str:
    """``"1, 2, 3"``, or ``"1-7"`` for a run of consecutive ranks longer than three."""
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)
