"""Telling "the file system is full" apart from other write failures, for a one-line error.

A write into a full file system fails with ``OSError`` (``ENOSPC``; ``EDQUOT`` over a quota;
``EFBIG`` past a file-size limit), but libraries writing through a stream may replace it with
their own error (``torch.save``: ``RuntimeError: unexpected pos ...``); the original stays in
the exception's chain (:class:`~cadence.checkpoint.manifest.HashingStream` makes sure of it for
checkpoint files). :func:`space_error` finds it there and builds the
:class:`~cadence.errors.CheckpointSpaceError` to raise instead.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil

from cadence.errors import CheckpointSpaceError
from cadence.units import format_size
from cadence.storage import Storage

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""The ``errno`` values that mean a write found no room: disk full, quota exceeded, file too large."""


def space_cause(error: BaseException) -> OSError | None:
    """The out-of-space ``OSError`` in ``error``'s chain (itself, then its ``__cause__`` or
    ``__context__``, and so on), or None when the failure is something else."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in SPACE_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


def free_bytes(storage: Storage, path: str) -> int | None:
    """Free bytes on the local file system holding ``path`` (or its nearest existing parent);
    None off local disks or when it cannot be told."""
    if not storage.atomic_rename:  # not a local disk: no meaningful free space
        return None
    while path and not os.path.exists(path):
        parent = posixpath.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or "/").free
    except OSError:
        return None


def space_error(error: BaseException, storage: Storage, what: str) -> CheckpointSpaceError | None:
    """The one-line :class:`CheckpointSpaceError` for ``error`` when it comes from a full file
    system (see :func:`space_cause`), else None. ``what`` says what failed, e.g. ``"save
    checkpoint step 20"``; the message adds the directory (``storage``'s root) and, on local
    disks, the free space left."""
    if isinstance(error, CheckpointSpaceError):
        return error
    cause = space_cause(error)
    if cause is None:
        return None
    reason = os.strerror(cause.errno).lower() if cause.errno is not None else str(cause)
    free = free_bytes(storage, storage.root)
    room = "" if free is None else f" ({format_size(free)} free)"
    return CheckpointSpaceError(
        f"cannot {what} in {storage.url(storage.root)}: {reason}{room}; nothing partial was kept "
        "and earlier checkpoints are intact: make room and run again to resume"
    )


def raise_if_full(error: BaseException, storage: Storage, what: str) -> None:
    """Raise :func:`space_error`'s error (from ``error``) when ``error`` comes from a full file
    system; otherwise return, and the caller re-raises ``error``."""
    full = space_error(error, storage, what)
    if full is not None and full is not error:
        raise full from error
