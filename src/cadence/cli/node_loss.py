"""A lost node of a multi-node ``cadence train`` job, named in its one-line error.

When a node is lost, the ranks of the surviving nodes fail in their next collective with a
transport error that names no one, and each surviving agent then reports its own rank as the
failed one. Instead, a surviving rank asks the heartbeats (:mod:`cadence.torch.runtime.heartbeat`)
which ranks on other nodes stopped answering, and records them in ``$CADENCE_TORCHRUN_LOST`` (a
path ``cadence train`` sets for its node; the first rank of the node to find them writes it), with
its own pid. ``cadence train`` then names the lost node and its ranks instead of its own rank,
provided the rank that recorded them is one that failed (:func:`lost_message`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from cadence.runtime.lost_peer import lost_a_peer

__all__ = ["LOST_ENV", "lost_message", "read_lost", "record_lost_nodes"]

logger = logging.getLogger("cadence")

LOST_ENV = "CADENCE_TORCHRUN_LOST"
"""Where a rank of this node records the ranks of other nodes that stopped answering (JSON)."""


def record_lost_nodes(exc: BaseException) -> bool:
    """In a rank of a multi-node job that failed with ``exc`` (typically a collective's error because
    another rank's process ended, :func:`~cadence.runtime.lost_peer.lost_a_peer`, or timed out because
    its machine vanished): find the ranks of other nodes whose heartbeat stopped (this waits a couple
    of seconds) and record them at ``$CADENCE_TORCHRUN_LOST``.

    Returns True when ``exc`` says a peer's process ended, ranks of other nodes stopped and none of
    this node's did: nothing on this node failed first, so this rank need not wait for its launcher
    to name another one (:func:`~cadence.runtime.lost_peer.wait_for_the_launcher`)."""
    path = os.environ.get(LOST_ENV)
    if not path or "torch" not in sys.modules:
        return False
    from cadence.torch.runtime import heartbeat

    here = heartbeat.this_rank()
    if here is None:
        return False
    silent = heartbeat.silent_ranks()
    elsewhere = [p for p in silent if p.node != here.node]
    if not elsewhere:
        return False
    lost = [{"rank": p.rank, "node": p.node, "host": p.host} for p in elsewhere]
    logger.error("rank %d: %s stopped answering (no heartbeat for %g s)", here.rank, _describe(_nodes(lost)),
                 heartbeat.SILENT_S)
    finding = {"pid": os.getpid(), "silent_s": heartbeat.SILENT_S, "lost": lost}
    try:
        with open(path, "x") as f:  # the first finding of this node stands
            json.dump(finding, f)
    except FileExistsError:
        pass
    except OSError as e:
        logger.warning("could not record the lost ranks in %s: %s", path, e)
    return len(elsewhere) == len(silent) and lost_a_peer(exc)


def read_lost(path: str) -> dict[str, Any] | None:
    """The finding a rank recorded at ``path`` (see :func:`record_lost_nodes`); None when there is none."""
    try:
        with open(path) as f:
            finding = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(finding, dict) and isinstance(finding.get("pid"), int) and isinstance(finding.get("lost"), list)
            and finding["lost"] and all(isinstance(p, dict) and isinstance(p.get("rank"), int) for p in finding["lost"])):
        return None
    return finding


def lost_message(finding: dict[str, Any] | None, failures: list[dict[str, Any]]) -> str | None:
    """The lost nodes of ``finding`` as the head of ``cadence train``'s one-line error, e.g. "node 1
    (rank 1, host h) was lost: its processes stopped answering ..."; None when there is no finding or
    the rank that recorded it is not among ``failures`` (an earlier attempt's)."""
    if finding is None or finding["pid"] not in {f.get("pid") for f in failures}:
        return None
    nodes = _nodes(finding["lost"])
    many = len(nodes) > 1
    silent = finding.get("silent_s")
    heard = f" (no heartbeat for {silent:g} s)" if isinstance(silent, (int, float)) else ""
    return (f"{_describe(nodes)} {'were' if many else 'was'} lost: {'their' if many else 'its'} processes stopped "
            f"answering{heard}, and the ranks on this node lost their connection to {'them' if many else 'it'}")


def _nodes(lost: list[dict[str, Any]]) -> dict[str, tuple[list[int], str]]:
    """node -> (its ranks, its host), in the order of their first rank."""
    nodes: dict[str, tuple[list[int], str]] = {}
    for place in sorted(lost, key=lambda p: p["rank"]):
        nodes.setdefault(str(place.get("node", "?")), ([], str(place.get("host", "?"))))[0].append(place["rank"])
    return nodes


def _describe(nodes: dict[str, tuple[list[int], str]]) -> str:
    parts = [f"{node} ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} on {host})"
             for node, (ranks, host) in nodes.items()]
    if len(parts) == 1:
        return f"node {parts[0]}"
    return f"nodes {', '.join(parts[:-1])} and {parts[-1]}"
