"""What a checkpoints directory's writer removes or moves aside: the leftovers of interrupted
saves and dead readers' leases (at start-up), checkpoints that do not verify (quarantine), and
the checkpoints retention deletes."""

from __future__ import annotations

import logging
import secrets
import time

from cadence.checkpoint.final import FINAL_TEMP
from cadence.checkpoint.leases import Leases
from cadence.checkpoint.listing import COMMITTED, CORRUPT_INFIX, TEMP, has_manifest, step_dir
from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

STALE_LEASE_GRACE = 3600.0
"""Seconds a lease must have been expired before the writer's start-up clean-up removes its file."""


def clean_up(storage: Storage, leases: Leases) -> None:
    """Remove what crashed saves left -- temp dirs, ``ckpt-N/`` without a manifest, ``FINAL`` temps
    -- and the lease files of readers dead for more than :data:`STALE_LEASE_GRACE` seconds. A
    failure is logged and skipped: a leftover never stops training."""
    try:
        leases.remove_expired(grace=STALE_LEASE_GRACE)
    except Exception:  # noqa: BLE001 - stale leases protect nothing anyway
        logger.warning("could not clean up stale leases in %s", storage.url(leases.root), exc_info=True)
    for name in storage.listdir(storage.root):
        path = storage.join(name)
        try:
            if TEMP.fullmatch(name) or (COMMITTED.fullmatch(name) and not has_manifest(storage, name)):
                storage.rmtree(path)
            elif FINAL_TEMP.fullmatch(name):
                storage.remove(path)
            else:
                continue
        except Exception:  # noqa: BLE001 - a leftover must not stop training
            logger.warning("could not remove leftover %s", storage.url(path), exc_info=True)
            continue
        logger.info("removed leftover of an interrupted save: %s", storage.url(path))


def quarantine(storage: Storage, step: int, reason: str) -> str:
    """Move checkpoint ``step`` aside to ``ckpt-<step>.corrupt-<UTC time>-<hex>/`` (kept for
    inspection, never deleted, no longer listed); return where it went (a path or URL)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = storage.join(f"ckpt-{step}{CORRUPT_INFIX}{stamp}-{secrets.token_hex(2)}")
    storage.rename(step_dir(storage, step), target)
    logger.warning("checkpoint %s does not verify (%s): moved aside to %s; the step is saved anew when reached",
                   storage.url(step_dir(storage, step)), reason, storage.url(target))
    return storage.url(target)


def delete_committed(storage: Storage, step: int) -> None:
    """Delete committed checkpoint ``step``: its manifest first (readers stop seeing it), then its
    directory. A ``ckpt-<step>`` that is a symbolic link is removed as a link: nothing it points to
    is deleted."""
    directory = step_dir(storage, step)
    if storage.link_under(directory) is None:
        storage.remove(storage.join(f"ckpt-{step}", MANIFEST_NAME))
    storage.rmtree(directory)
    logger.debug("deleted checkpoint %s (retention)", storage.url(directory))
