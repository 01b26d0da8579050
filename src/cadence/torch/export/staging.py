"""Staging and publishing an export directory, so that a half-written export never appears.

On local disks an export is written into a temp sibling directory and renamed into place; on other
stores (object stores, ``memory://``) it is written locally, then uploaded with ``metadata.json``
(and ``signatures.json``) last: an export is complete when its metadata exists.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import shutil
import tempfile
from typing import Iterator

from cadence.storage import Storage
from cadence.torch.export.metadata import METADATA_FILE, SIGNATURES_FILE

__all__ = ["stage_and_publish", "user_path"]


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
    """The files under ``local`` as relative ``/`` paths, in upload order: artefacts, then each
    ``metadata.json``, then ``signatures.json`` (an export is complete once those exist)."""
    names = []
    for root, _, files in os.walk(local):
        rel = os.path.relpath(root, local)
        names += [name if rel == "." else posixpath.join(rel.replace(os.sep, "/"), name) for name in files]
    return sorted(names, key=lambda n: (n == SIGNATURES_FILE, posixpath.basename(n) == METADATA_FILE, n))


def _publish_local(storage: Storage, temp: str) -> None:
    """Rename the staged ``temp`` dir to ``storage.root``, replacing an existing export there."""
    final = storage.root
    _fsync_files(storage, temp)
    if storage.exists(final):
        old = _temp_name(final, "old")
        storage.rename(final, old)
        storage.rename(temp, final)
        storage.rmtree(old)
    else:
        storage.rename(temp, final)


def _upload(storage: Storage, local: str) -> None:
    """Copy the staged files to ``storage.root`` (replacing what is there), metadata last."""
    for marker in (SIGNATURES_FILE, METADATA_FILE):  # the old export stops looking complete first
        if storage.exists(storage.join(marker)):
            storage.remove(storage.join(marker))
    storage.rmtree(storage.root)
    storage.makedirs(storage.root)
    for name in _staged_files(local):
        if "/" in name:
            storage.makedirs(storage.join(posixpath.dirname(name)))
        with open(os.path.join(local, *name.split("/")), "rb") as src, storage.open_write(storage.join(name)) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


@contextlib.contextmanager
def stage_and_publish(storage: Storage) -> Iterator[str]:
    """A local directory to write the export into; published to ``storage.root`` on success."""
    if storage.atomic_rename:
        storage.makedirs(posixpath.dirname(storage.root))
        temp = _temp_name(storage.root)
        storage.makedirs(temp)
        try:
            yield temp
            _publish_local(storage, temp)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    else:
        with tempfile.TemporaryDirectory(prefix="cadence-export-") as temp:
            yield temp
            _upload(storage, temp)


def user_path(storage: Storage, directory: str, name: str) -> str:
    """``name`` in ``directory`` as the caller wrote it: a URL stays a URL, a local path is absolute."""
    if storage.atomic_rename:
        return storage.url(storage.join(name))
    return f"{directory.rstrip('/')}/{name}"
