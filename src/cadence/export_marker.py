"""Which directories are cadence's own exports, and where an export may be published.

Every export cadence publishes holds :data:`MARKER_FILE` (``.cadence-export.json``):
``{"format": "cadence-export", "version": 1, "files": [...]}``, the relative ``/`` paths of every
other file cadence wrote there (uploaded first on object stores, so that an upload cut short is
still recognised). An export's directory may be replaced by a new one only when it is

* absent, or an empty directory;
* a cadence export holding no file its marker does not list (a subset is fine: an upload or a
  deletion cut short) and no directory but those files' parents;
* an export written before the marker: ``metadata.json`` with cadence's keys (``format_version``,
  ``formats``, ``files``, ``cadence_version``) whose ``files`` list every file there; for one with
  signatures, ``signatures.json`` and each signature directory's own such ``metadata.json``.

Anything else -- a file, a symbolic link, a directory holding a file cadence did not write -- is
refused with :class:`ExportTargetError` (bad input, exit 2): cadence never deletes what it did not
write. No torch: :mod:`cadence.actions` (export retention) uses it too.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from typing import Any, Iterable

from cadence.errors import ConfigError
from cadence.storage import Storage, unwritable_reason

__all__ = ["MARKER_FILE", "ExportTargetError", "check_export_target", "export_files", "marker_bytes", "refusal",
           "remove_export"]

MARKER_FILE = ".cadence-export.json"
MARKER_FORMAT = "cadence-export"
MARKER_VERSION = 1
_METADATA = "metadata.json"
_SIGNATURES = "signatures.json"
_METADATA_KEYS = frozenset({"format_version", "formats", "files", "cadence_version"})
_SIGNATURES_KEYS = frozenset({"format_version", "signatures", "formats"})
_CHOOSE = "choose an empty or new directory"


class ExportTargetError(ConfigError):
    """An export's directory holds something cadence did not write (or is a file or a link): the
    export is refused, nothing is written or deleted. The message names the path and why."""


def marker_bytes(files: Iterable[str]) -> bytes:
    """The marker's content for an export of ``files`` (relative ``/`` paths, the marker excluded)."""
    listed = sorted(set(files) - {MARKER_FILE})
    return json.dumps({"format": MARKER_FORMAT, "version": MARKER_VERSION, "files": listed}, indent=1).encode()


def _read_json(storage: Storage, path: str) -> Any:
    try:
        return json.loads(storage.read_bytes(path))
    except (OSError, ValueError):  # missing, a directory, unreadable, not JSON
        return None


def _safe(name: Any, *, nested: bool) -> bool:
    """A relative path inside the export: no absolute path, ``..``, ``.`` or empty part."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        return False
    parts = name.split("/")
    return (nested or len(parts) == 1) and all(p not in ("", ".", "..") for p in parts)


def _metadata_files(meta: Any) -> set[str] | None:
    """The files a pre-marker ``metadata.json`` lists, or None when it is not cadence's."""
    if not isinstance(meta, dict) or not meta.keys() >= _METADATA_KEYS or not isinstance(meta["files"], list):
        return None
    files = meta["files"]
    return set(files) if all(_safe(f, nested=False) for f in files) and _METADATA in files else None


def _legacy_files(storage: Storage, path: str) -> set[str] | None:
    """The files of an export written before the marker (see the module docstring), or None."""
    files = _metadata_files(_read_json(storage, posixpath.join(path, _METADATA)))
    if files is not None:
        return files
    listing = _read_json(storage, posixpath.join(path, _SIGNATURES))
    if not isinstance(listing, dict) or not listing.keys() >= _SIGNATURES_KEYS:
        return None
    signatures = listing["signatures"]
    if not isinstance(signatures, dict) or not signatures:
        return None
    found = {_SIGNATURES}
    for entry in signatures.values():
        directory = entry.get("directory") if isinstance(entry, dict) else None
        if not isinstance(directory, str) or not _safe(directory, nested=False):
            return None
        own = _metadata_files(_read_json(storage, posixpath.join(path, directory, _METADATA)))
        if own is None:
            return None
        found |= {f"{directory}/{name}" for name in own}
    return found


def export_files(storage: Storage, path: str) -> frozenset[str] | None:
    """The files cadence wrote in the export at directory ``path`` (relative ``/`` paths, the marker
    included), by its marker, else by its pre-marker metadata; None when neither makes it one."""
    marker = _read_json(storage, posixpath.join(path, MARKER_FILE))
    if marker is not None:
        files = marker.get("files") if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None
        if not isinstance(files, list) or not all(_safe(f, nested=True) for f in files):
            return None
        return frozenset({*files, MARKER_FILE})
    legacy = _legacy_files(storage, path)
    return None if legacy is None else frozenset(legacy)


def _first_foreign(entries: dict[str, str], files: frozenset[str]) -> str | None:
    """The first entry (in sorted order) that is neither one of ``files`` nor a parent of one."""
    parents = {p for f in files for p in _ancestors(posixpath.dirname(f))}
    for name, kind in entries.items():
        if not ((kind == "file" and name in files) or (kind == "dir" and name in parents)):
            return name
    return None


def _ancestors(path: str) -> list[str]:
    parts = path.split("/") if path else []
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _assess(storage: Storage, path: str) -> tuple[str | None, bool]:
    """``(why an export may not replace path, or None; whether it holds an export to replace)``."""
    kind = storage.entry_kind(path)
    if kind is None:
        return None, False
    if kind == "link":
        return "is a symbolic link, not a cadence export", False
    if kind != "dir":
        return "exists and is a file, not a cadence export", False
    files = export_files(storage, path)
    if files is None:  # no walk through a user's (maybe huge) tree: its first entry says enough
        top = storage.listdir(path)
        return (f"exists and is not a cadence export (holds {top[0]})" if top else None), False
    foreign = _first_foreign(storage.tree(path), files)
    if foreign is not None:
        return f"is a cadence export that also holds {foreign}, which cadence did not write", False
    return None, True


def refusal(storage: Storage, path: str) -> str | None:
    """Why an export may not replace what is at ``path`` (a phrase), or None when it may (see the
    module docstring). Reads only: nothing is created or changed."""
    return _assess(storage, path)[0]


def check_export_target(storage: Storage, path: str | None = None, *, label: str = "export directory",
                        shown: str | None = None) -> bool:
    """Whether ``path`` (default ``storage.root``) holds a cadence export that a new export replaces
    (False: nothing there, or an empty directory). Raises :class:`ExportTargetError`, one line
    ``<label> <shown>: <why>; choose an empty or new directory`` (``shown``: default the path's
    URL), when anything else is there."""
    path = storage.root if path is None else path
    why, replaces = _assess(storage, path)
    if why is None and storage.atomic_rename:  # a local path: a file on it, a directory it may not write
        why = unwritable_reason(path)
    if why is not None:
        raise ExportTargetError(f"{label} {shown or storage.url(path)}: {why}; {_CHOOSE}")
    return replaces


def _removal_order(name: str) -> tuple[bool, bool, str]:
    """Completion files first (the export stops looking complete), the marker last."""
    return (name == MARKER_FILE, posixpath.basename(name) not in (_SIGNATURES, _METADATA), name)


def remove_export(storage: Storage, path: str) -> list[str]:
    """Delete the cadence export at directory ``path``: only the files it lists (``metadata.json``
    and ``signatures.json`` first, the marker last), then its directories that are left empty, and
    ``path`` itself when empty (local disks). Returns what is left under ``path`` (entries cadence
    did not write, e.g. added since a check), which is never deleted."""
    files = export_files(storage, path) or frozenset()
    for name in sorted(files, key=_removal_order):
        try:
            storage.remove(posixpath.join(path, name))
        except OSError:  # gone already, or no longer a plain file of ours (a directory, below a link): left
            continue
    for name in [*sorted({a for f in files for a in _ancestors(posixpath.dirname(f))}, key=len, reverse=True), ""]:
        with contextlib.suppress(OSError):  # not empty (a user's file), or below a link: left
            storage.remove_empty_dir(posixpath.join(path, name) if name else path)
    return list(storage.tree(path))
