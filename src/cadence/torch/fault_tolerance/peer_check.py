"""What every replica group must share, and the check a healing group makes of its peer's.

Groups started by hand (across machines) may be started with different configs or numbers of
processes; torchft would then average gradients of different models, or of different settings,
without a word. So each group describes itself (:func:`group_identity`: its id, its world size and a
digest of each field of its validated config) and sends that in its healing state; a group that heals
-- a restarted or late one, and at a fresh start every group but the lowest-numbered one, torchft's
``init_sync`` -- compares it with its own (:func:`refusal`) before it loads any tensor and is refused
with one line (a :class:`~cadence.errors.ConfigError`, exit 2) when they differ.

Not compared (:data:`PER_GROUP_FIELDS`): what names or places the group itself, and what does not
change the training -- where it writes and runs, its lighthouse address and torchft timeouts, its
device, its watchdog, logging, checkpoint writing and retention, evaluators, exports and trackers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from cadence.config import ExperimentConfig
from cadence.errors import ConfigError

__all__ = ["IDENTITY_KEY", "PER_GROUP_FIELDS", "PeerMismatchError", "config_digests", "differing_fields",
           "group_identity", "refusal"]


class PeerMismatchError(ConfigError):
    """This replica group does not match the peer it was to heal from (:func:`refusal`'s line): bad
    input, exit 2. Found by the ranks that have a peer of their group rank; a rank without one (a
    group of more ranks than its peer's) may wait in torchft for a peer that does not exist, so a rank
    that raises this ends at once under torchrun (``every_rank``) and the group's launcher stops the
    others: the job ends with this one line."""

    every_rank = True

IDENTITY_KEY = "group_identity"
"""The key of a group's :func:`group_identity` in the healing state it sends."""

PER_GROUP_FIELDS: tuple[str, ...] = (
    "model_dir", "workdir",
    "trainer.fault_tolerance.replica_id", "trainer.fault_tolerance.lighthouse",
    "trainer.fault_tolerance.connect_timeout_s", "trainer.fault_tolerance.timeout_s",
    "trainer.fault_tolerance.quorum_timeout_s", "trainer.fault_tolerance.join_timeout_s",
    "trainer.fault_tolerance.heartbeat_timeout_s",
    "trainer.device", "trainer.hang_timeout", "trainer.peak_tflops", "trainer.log_throughput",
    "trainer.summary_interval", "trainer.sanity_val_steps", "trainer.max_to_keep", "trainer.keep_every_n_steps",
    "trainer.save_on_preemption",
    "checkpoint", "sidecar", "evaluators", "export", "loggers", "profiler",
)
"""The config fields (dotted paths; a section stands for all its fields) that may differ between groups."""

SHOWN = 3
"""How many differing fields the refusal names (then ``and N more``)."""


def _leaves(data: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of every leaf of ``data``: a mapping is descended into unless empty;
    anything else (a list, a scalar, None) is one leaf."""
    if isinstance(data, Mapping) and data:
        for key, value in data.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    else:
        yield path, data


def _per_group(path: str) -> bool:
    return any(path == field or path.startswith(field + ".") for field in PER_GROUP_FIELDS)


def config_digests(cfg: ExperimentConfig) -> dict[str, str]:
    """``{dotted path: digest}`` of every leaf of the validated config (by alias: ``task.class``, as
    written) but the :data:`PER_GROUP_FIELDS`: the same for two configs that train alike."""
    digests = {}
    for path, value in _leaves(cfg.model_dump(by_alias=True), ""):
        if not _per_group(path):
            text = json.dumps(value, sort_keys=True, default=repr)
            digests[path] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return digests


def group_identity(cfg: ExperimentConfig, replica_id: int, world_size: int) -> dict[str, Any]:
    """What a group sends a healing peer about itself: ``{"replica_id", "world_size", "config"}``
    (plain data; ``config``: :func:`config_digests`)."""
    return {"replica_id": replica_id, "world_size": world_size, "config": config_digests(cfg)}


def differing_fields(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The sorted paths whose digests differ or that one side lacks, a path under another one of
    them left out (``trainer.ema`` null on one side: ``trainer.ema``, not each of its fields)."""
    differing = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    found = set(differing)

    def under_another(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in found for i in range(1, len(parts)))

    return [k for k in differing if not under_another(k)]


def refusal(mine: Mapping[str, Any], theirs: Mapping[str, Any] | None) -> str | None:
    """The one-line reason why this group (``mine``) must not take the state of the peer that sent
    ``theirs`` (its :func:`group_identity`; None: it sent none), or None when they train alike."""
    me = mine["replica_id"]
    if theirs is None:
        return (f"trainer.fault_tolerance: replica group {me} healed from a peer that sent no description of "
                f"its config to compare (another cadence version?): start every group with the same cadence")
    peer = theirs.get("replica_id", "?")
    problems = []
    fields = differing_fields(mine["config"], theirs.get("config", {}))
    if fields:
        shown = ", ".join(fields[:SHOWN]) + (f" and {len(fields) - SHOWN} more" if len(fields) > SHOWN else "")
        problems.append(f"its config differs from group {peer}'s in {shown}")
    if mine["world_size"] != theirs.get("world_size"):
        problems.append(f"it runs {mine['world_size']} process(es), group {peer} runs {theirs.get('world_size')}")
    if not problems:
        return None
    return (f"trainer.fault_tolerance: replica group {me} cannot join group {peer}: {'; '.join(problems)} "
            f"(every group must run the same config on the same number of processes)")
