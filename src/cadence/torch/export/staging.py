"""Staging and publishing an export directory, so that a half-written export never appears, and
nothing cadence did not write is ever deleted.

The target must be absent, an empty directory, or a cadence export to replace
(:mod:`cadence.export_marker`): it is checked before anything is created, and again when the export
is published; anything else raises :class:`~cadence.export_marker.ExportTargetError` (exit 2) and
nothing is touched. Every export holds the marker, ``.cadence-export.json``, listing its files.

On local disks an export is written into a temp sibling directory and renamed into place (an
export it replaces is first moved aside, checked again, and only the files its marker lists are
deleted). On other stores (object stores, ``memory://``) it is written locally, the export it
replaces deleted file by file (its metadata first, its marker last), then it is uploaded with the
marker first and ``metadata.json`` (and ``signatures.json``) last: an export is complete when its
metadata exists.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import secrets
import shutil
import tempfile
from typing import Iterator

from cadence.export_marker import MARKER_FILE, ExportTargetError, check_export_target, marker_bytes, remove_export
from cadence.storage import Storage
from cadence.torch.export.metadata import METADATA_FILE, SIGNATURES_FILE

__all__ = ["stage_and_publish", "user_path"]

log = logging.getLogger(__name__)
_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
"""A rename into place failed on these: something that is not ours appeared at the target."""


def _temp_name(path: str, kind: str = "tmp") -> str:
    return f"{path}.{kind}-{secrets.token_hex(6)}"


def _fsync_files(storage: Storage, directory: str) -> None:
    """fsync every file under ``directory`` (signature subdirectories included), then the dirs."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            _fsync_files(storage, path)
            continue
        storage.fsync_file(path)
    storage.fsync_dir(directory)


def _staged_files(local: str) -> list[str]:
    """The files under ``local`` as relative ``/`` paths, in upload order: the marker, the
    artefacts, then each ``metadata.json``, then ``signatures.json`` (an export is complete once
    those exist; it is recognised as cadence's from its first file on)."""
    names = []
    for root, _, files in os.walk(local):
        rel = os.path.relpath(root, local)
        names += [name if rel == "." else posixpath.join(rel.replace(os.sep, "/"), name) for name in files]
    return sorted(names, key=lambda n: (n != MARKER_FILE, n == SIGNATURES_FILE, posixpath.basename(n) == METADATA_FILE, n))


def _write_marker(stage: str) -> None:
    """The marker listing every staged file, written into the stage before it is published."""
    with open(os.path.join(stage, MARKER_FILE), "wb") as f:
        f.write(marker_bytes(_staged_files(stage)))


def _taken(storage: Storage, label: str) -> ExportTargetError:
    """The error for a target that changed since it was checked (the check's own one, if it fails)."""
    check_export_target(storage, label=label)
    return ExportTargetError(f"{label} {storage.url(storage.root)}: something appeared there while the export was "
                             "written; choose an empty or new directory")


def _publish_local(storage: Storage, temp: str, label: str) -> None:
    """Rename the staged ``temp`` dir to ``storage.root``; an export there is replaced, its own files
    deleted (moved aside first and checked again, so a file added meanwhile is never deleted)."""
    final = storage.root
    _fsync_files(storage, temp)
    if not check_export_target(storage, label=label):
        try:
            storage.rename(temp, final)  # replaces an empty directory; fails on anything else
        except OSError as e:
            if e.errno not in _TAKEN:
                raise
            raise _taken(storage, label) from None
        return
    old = _temp_name(final, "old")
    storage.rename(final, old)
    aside = Storage(old)
    try:  # aside, nothing more can be added through its path: checked again, it is what is deleted
        check_export_target(aside, label=label, shown=storage.url(final))
        storage.rename(temp, final)
    except BaseException as e:
        try:
            storage.rename(old, final)  # as it was
        except OSError:
            log.warning("the export %s, moved aside to %s, could not be put back: something took its place", final, old)
        if isinstance(e, OSError) and e.errno in _TAKEN:
            raise _taken(storage, label) from None
        raise
    left = remove_export(aside, old)
    if left:
        log.warning("kept %s, the export %s replaced: it holds %s, which cadence did not write", old, final, left[0])


def _upload(storage: Storage, local: str, label: str) -> None:
    """Copy the staged files to ``storage.root`` (replacing a cadence export there), marker first,
    metadata last."""
    if check_export_target(storage, label=label):
        left = remove_export(storage, storage.root)
        if left:
            log.warning("%s holds %s, which cadence did not write: left beside the new export",
                        storage.url(storage.root), left[0])
    storage.makedirs(storage.root)
    for name in _staged_files(local):
        if "/" in name:
            storage.makedirs(storage.join(posixpath.dirname(name)))
        with open(os.path.join(local, *name.split("/")), "rb") as src, storage.open_write(storage.join(name)) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


@contextlib.contextmanager
def stage_and_publish(storage: Storage, *, label: str = "export directory") -> Iterator[str]:
    """A local directory to write the export into; published to ``storage.root`` on success with
    the marker listing its files.

    Raises :class:`~cadence.export_marker.ExportTargetError` (``label`` names the target in its one
    line) on entry, before anything is created, and again at publishing, when ``storage.root`` is
    neither absent, an empty directory nor a cadence export; nothing is then deleted."""
    check_export_target(storage, label=label)
    if storage.atomic_rename:
        storage.makedirs(posixpath.dirname(storage.root))
        temp = _temp_name(storage.root)
        storage.makedirs(temp)
        try:
            yield temp
            _write_marker(temp)
            _publish_local(storage, temp, label)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    else:
        with tempfile.TemporaryDirectory(prefix="cadence-export-") as temp:
            yield temp
            _write_marker(temp)
            _upload(storage, temp, label)


def user_path(storage: Storage, directory: str, name: str) -> str:
    """``name`` in ``directory`` as the caller wrote it: a URL stays a URL, a local path is absolute."""
    if storage.atomic_rename:
        return storage.url(storage.join(name))
    return f"{directory.rstrip('/')}/{name}"
