"""``FINAL``: the record that training completed, ``{"step": N, "time": ..., "reason": ...}``.

It names a committed checkpoint; ``reason`` (optional) says why training stopped there before its
target (an action's stop: early stopping, a sweep's pruner). Written atomically
(:meth:`~cadence.storage.Storage.write_atomic`): a crash leaves the old record or the new one,
and at most a ``FINAL.tmp-<hex>`` file the writer's start-up clean-up removes.
"""

from __future__ import annotations

import json
import logging
import re
import time

from cadence.checkpoint.listing import check_step
from cadence.checkpoint.space import raise_if_full
from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

FINAL_NAME = "FINAL"
FINAL_TEMP = re.compile(re.escape(FINAL_NAME) + r"\.tmp-[0-9a-f]+")
"""The name of an interrupted write of ``FINAL``."""


def write_final(storage: Storage, step: int, reason: str | None = None) -> None:
    """Write ``FINAL`` naming ``step`` (and ``reason`` when given) now; a full disk raises
    :class:`~cadence.errors.CheckpointSpaceError`."""
    data = json.dumps({"step": step, "time": time.time(), **({"reason": reason} if reason else {})}).encode()
    try:
        storage.write_atomic(storage.join(FINAL_NAME), data)
    except OSError as e:
        raise_if_full(e, storage, f"write {FINAL_NAME} for step {step}")
        raise


def read_final_step(storage: Storage) -> int | None:
    """The step named by ``FINAL``, or None when there is none (an unreadable one is warned about)."""
    path = storage.join(FINAL_NAME)
    try:
        document = json.loads(storage.read_bytes(path))
        step = document["step"]
        return check_step(step)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("ignoring unreadable %s: %s", storage.url(path), e)
        return None


def remove_final(storage: Storage) -> None:
    """Remove ``FINAL``; nothing happens when there is none."""
    path = storage.join(FINAL_NAME)
    if storage.exists(path):
        storage.remove(path)
