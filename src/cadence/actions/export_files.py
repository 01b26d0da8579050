"""Names and retention of a group of exports: :class:`ExportFileManager` (Orbit's, fixed)."""

from __future__ import annotations

import logging
import os
import posixpath
import re
from typing import Any, Callable

from cadence.export_marker import refusal, remove_export
from cadence.storage import Storage, is_plain_path

logger = logging.getLogger("cadence")

__all__ = ["ExportFileManager"]

DEFAULT_MAX_EXPORTS = 5
"""How many exports clean-up keeps unless told (Orbit's default; ``export.max_to_keep``'s too)."""

_ID = re.compile(r"0|[1-9][0-9]*")  # the canonical decimal form next_name writes


def _relative_path(subdirectory: object) -> str:
    """``subdirectory`` normalised (``a//b/`` and ``./a/b`` are ``a/b``). ValueError unless it names
    a path strictly inside its parent, so that clean-up never deletes outside ``base-<id>/``."""
    if isinstance(subdirectory, str) and not subdirectory.startswith("/"):
        parts = [part for part in subdirectory.split("/") if part not in ("", ".")]
        if parts and ".." not in parts:
            return "/".join(parts)
    raise ValueError(
        f"ExportFileManager: subdirectory must be a relative path inside base-<id>/, got {subdirectory!r}")


class ExportFileManager:
    """Names the members of a group of exports ``{base_name}{separator}{id}`` and deletes old ones.

    A member is a file or a directory whose name is *exactly* ``base_name + separator + <id>``,
    ``<id>`` a non-negative integer in plain decimal (``base-7``; not ``base-07``, ``base-7.tmp``,
    ``base-x`` or ``basefoo-7``). Anything else next to them is never touched. Members are
    ordered by id, not by modification time.

    ``separator="/"`` makes ``base_name`` a directory whose integer-named children are the members
    (``export/best/200/``, ``export/best/400/``, ...).

    With ``subdirectory`` (Orbit's option), a member is ``{base_name}{separator}{id}/{subdirectory}``:
    :meth:`next_name` returns that path, only ids whose ``subdirectory`` exists count, and
    :meth:`clean_up` deletes the ``subdirectory`` alone, leaving the rest of ``base-<id>/`` (other
    artefacts written beside it) in place.

    With ``exports_only`` (cadence's own exports, ``export/<name>/<step>/``), clean-up deletes only
    what cadence wrote: a member that is a cadence export (:mod:`cadence.export_marker`) loses the
    files its marker lists, an empty directory is removed, and anything else -- a file, a link, a
    directory holding a file cadence did not write -- is left alone with a warning.

    Works on local paths and fsspec URLs (``memory://``, ``s3://``) through
    :class:`~cadence.storage.Storage`; returned names have ``base_name``'s form (a URL stays a URL).

    Args:
      base_name: the members' common prefix (a path or URL). A trailing ``/`` is dropped; a local
        path is normalised (``os.path.normpath``, as Orbit does).
      max_to_keep: how many members :meth:`clean_up` keeps (the highest ids). ``None``: all are
        kept. ``0``: none are kept (Orbit's ``max_to_keep=0`` deleted nothing).
      next_id_fn: a callable returning the next id (an int >= 0), e.g. the global step, so that
        exports are named by step. ``None``: a counter that starts after the highest existing id
        (0 when there is none) and so resumes its numbering after a restart, gaps included.
      separator: between ``base_name`` and the id; non-empty. ``"/"`` or ``"-"`` typically.
      subdirectory: a relative path inside each ``base-<id>`` that is the member (normalised:
        ``saved_model/`` is ``saved_model``); ``None``: the ``base-<id>`` file or directory itself.
      exports_only: delete only cadence's exports (above); ``False``: any member (Orbit's).
      storage_options: passed to fsspec.

    Raises:
      ValueError: empty ``base_name`` or ``separator``; ``max_to_keep`` not None or an int >= 0;
        a ``subdirectory`` that is not a relative path inside ``base-<id>`` (empty, absolute, or
        with a ``..`` part).
    """

    def __init__(
        self,
        base_name: str,
        max_to_keep: int | None = DEFAULT_MAX_EXPORTS,
        next_id_fn: Callable[[], int] | None = None,
        separator: str = "-",
        *,
        subdirectory: str | None = None,
        exports_only: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(separator, str) or not separator:
            raise ValueError(f"ExportFileManager: separator must be a non-empty string, got {separator!r}")
        stripped = base_name.rstrip("/") if isinstance(base_name, str) else ""
        if stripped and is_plain_path(stripped):
            stripped = os.path.normpath(stripped)  # as Orbit: "foo//bar/base" names "foo/bar/base-<id>"
        if not stripped:
            raise ValueError(f"ExportFileManager: base_name must be a non-empty path, got {base_name!r}")
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 0
        ):
            raise ValueError(
                f"ExportFileManager: max_to_keep must be None (keep all) or an int >= 0, got {max_to_keep!r}"
            )
        self.base_name = stripped
        self.separator = separator
        self.subdirectory = None if subdirectory is None else _relative_path(subdirectory)
        self.max_to_keep = max_to_keep
        self.exports_only = exports_only
        self._next_id_fn = next_id_fn
        self._storage = Storage(stripped, storage_options)
        # Split "<fs path of base_name><separator>" at its last "/": the directory listed, and the
        # prefix a member's name starts with inside it ("" when the separator is "/").
        directory, _, self._prefix = (self._storage.root + separator).rpartition("/")
        self._dir = directory or "/"
        self._counter = 0

    def __repr__(self) -> str:
        return (
            f"ExportFileManager({self.base_name!r}, max_to_keep={self.max_to_keep!r}, "
            f"separator={self.separator!r}, subdirectory={self.subdirectory!r}, exports_only={self.exports_only!r})"
        )

    def _name(self, id_: int) -> str:
        name = f"{self.base_name}{self.separator}{id_}"
        return name if self.subdirectory is None else f"{name}/{self.subdirectory}"

    def _members(self) -> list[tuple[int, str]]:
        """``(id, file-system path)`` of every member, by increasing id."""
        members = []
        for entry in self._storage.listdir(self._dir):
            if not entry.startswith(self._prefix):
                continue
            suffix = entry[len(self._prefix):]
            if not _ID.fullmatch(suffix):
                continue
            path = f"{self._dir.rstrip('/')}/{entry}"
            if self.subdirectory is not None:
                path = f"{path}/{self.subdirectory}"
                if not self._storage.exists(path):
                    continue
            members.append((int(suffix), path))
        return sorted(members)

    @property
    def managed_ids(self) -> list[int]:
        """The ids of the existing members, increasing."""
        return [id_ for id_, _ in self._members()]

    @property
    def managed_files(self) -> list[str]:
        """The existing members' names (``base_name`` form), by increasing id."""
        return [self._name(id_) for id_, _ in self._members()]

    def next_name(self) -> str:
        """A name for a new member: ``f"{base_name}{separator}{id}"`` (``/{subdirectory}`` after it).

        ``id`` is ``next_id_fn()`` when given (its name may already exist: the caller replaces
        it). Otherwise it is one more than both the highest existing id and the last id this
        manager handed out, so names are not repeated even before the previous one is written.

        Raises:
          ValueError: ``next_id_fn`` returned something other than an int >= 0.
        """
        if self._next_id_fn is not None:
            id_ = self._next_id_fn()
            if hasattr(id_, "item") and callable(id_.item):  # a tensor / NumPy step counter
                id_ = id_.item()
            if not isinstance(id_, int) or isinstance(id_, bool) or id_ < 0:
                raise ValueError(f"ExportFileManager: next_id_fn returned {id_!r}; expected an int >= 0")
        else:
            ids = self.managed_ids
            id_ = max(self._counter, ids[-1] + 1 if ids else 0)
            self._counter = id_ + 1
        return self._name(id_)

    def clean_up(self) -> list[str]:
        """Delete all members but the ``max_to_keep`` with the highest ids (files or directories).

        ``max_to_keep=None`` deletes nothing; ``0`` deletes every member. A member that vanishes
        meanwhile (deleted by another process) is skipped. Links are never followed: a member that
        is a symbolic link is removed as a link (kept, with ``exports_only``), and one below a link
        (``base-<id>/`` of a ``subdirectory`` member) is kept with a warning. With ``exports_only``
        only cadence's exports are deleted (see the class). Returns the deleted names, oldest first.
        """
        if self.max_to_keep is None:
            return []
        members = self._members()
        doomed = members[: max(0, len(members) - self.max_to_keep)]
        deleted = []
        for id_, path in doomed:
            link = self._storage.link_under(posixpath.dirname(path), self._dir)
            if link is not None:  # deleting through it could delete outside the group
                logger.warning("not deleting old export %s: %s is a symbolic link", self._name(id_), link)
                continue
            if self.exports_only:
                if self._delete_export(id_, path):
                    deleted.append(self._name(id_))
                continue
            try:
                if self._storage.isdir(path):
                    self._storage.rmtree(path)
                else:
                    self._storage.remove(path)
            except FileNotFoundError:
                continue
            deleted.append(self._name(id_))
            logger.debug("deleted old export %s", self._name(id_))
        return deleted

    def _delete_export(self, id_: int, path: str) -> bool:
        """Delete the member at ``path`` when it is a cadence export (or empty); warn and keep it otherwise."""
        if self._storage.entry_kind(path) is None:  # deleted meanwhile
            return False
        why = refusal(self._storage, path)
        if why is not None:
            logger.warning("not deleting old export %s: it %s", self._name(id_), why)
            return False
        left = remove_export(self._storage, path)
        if left:
            logger.warning("old export %s: kept %s, which cadence did not write", self._name(id_), left[0])
            return False
        logger.debug("deleted old export %s", self._name(id_))
        return True
