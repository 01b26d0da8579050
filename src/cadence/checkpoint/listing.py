"""The names in a checkpoints directory and which checkpoints are committed (read-only).

Layout of the directory (the model dir's ``checkpoints/``)::

    ckpt-<step>/            one committed checkpoint: its files, state.json, MANIFEST.json (last)
    ckpt-<step>.tmp-<hex>/  a checkpoint being written (local disks); invisible, cleaned at start-up
    ckpt-<step>/.claim      (other stores) who writes ckpt-<step>/: created exclusively before its files
    ckpt-<step>.corrupt-<time>-<hex>/  a checkpoint moved aside because it did not verify
    FINAL                   {"step": N, "time": ..., "reason": ...}: training completed at step N
                            (reason: why it stopped early, when an action stopped it)
    .leases/                readers' leases (not a checkpoint; see :mod:`cadence.checkpoint.leases`)

A checkpoint is committed when ``ckpt-<step>/MANIFEST.json`` exists; nothing here hashes files.
"""

from __future__ import annotations

import re

from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.errors import NoCheckpointError
from cadence.storage import Storage

COMMITTED = re.compile(r"ckpt-(0|[1-9][0-9]*)")
"""The name of a checkpoint's directory, committed or not: ``ckpt-<step>``."""
TEMP = re.compile(r"ckpt-(0|[1-9][0-9]*)\.tmp-[0-9a-f]+")
"""The name of a checkpoint being written on a local disk."""
CORRUPT_INFIX = ".corrupt-"
"""Between ``ckpt-<step>`` and the time in the name of a checkpoint moved aside as corrupt."""
CORRUPT = re.compile(r"ckpt-(0|[1-9][0-9]*)" + re.escape(CORRUPT_INFIX) + r"[0-9TZ]+-[0-9a-f]+")
"""The name of a checkpoint moved aside as corrupt."""


def check_step(step: object) -> int:
    """``step`` when it is an int >= 0 (not a bool); else ``ValueError``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step is an int >= 0, got {step!r}")
    return step


def step_dir(storage: Storage, step: int) -> str:
    """The file-system path of ``ckpt-<step>/`` in ``storage``."""
    return storage.join(f"ckpt-{step}")


def has_manifest(storage: Storage, dirname: str) -> bool:
    """Whether ``dirname`` (a name in the directory, e.g. ``ckpt-5``) holds a manifest: committed."""
    return storage.exists(storage.join(dirname, MANIFEST_NAME))


def committed_steps(storage: Storage) -> list[int]:
    """Steps of the committed checkpoints, ascending; empty when the directory does not exist."""
    found = []
    for name in storage.listdir(storage.root):
        match = COMMITTED.fullmatch(name)
        if match and has_manifest(storage, name):
            found.append(int(match.group(1)))
    return sorted(found)


def require_committed(storage: Storage, step: int) -> None:
    """Raise :class:`~cadence.errors.NoCheckpointError` (a ``CheckpointError``; bad input, exit 2),
    listing the committed steps, unless ``step`` is committed."""
    if not has_manifest(storage, f"ckpt-{step}"):
        raise NoCheckpointError(
            f"no committed checkpoint for step {step} in {storage.url(storage.root)}; "
            f"available steps: {committed_steps(storage)}"
        )


def quarantined(storage: Storage) -> list[str]:
    """The names of the checkpoints moved aside because they did not verify, sorted."""
    return sorted(n for n in storage.listdir(storage.root) if CORRUPT.fullmatch(n))
