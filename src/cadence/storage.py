"""A small file-system facade over fsspec, with durable (fsync) and atomic writes on local disks.

Paths handed to and returned by :class:`Storage` methods are the file system's own paths (what
:meth:`Storage.join` returns), not URLs; :meth:`Storage.url` turns one into a location for
messages and users (an absolute path on local disks, an fsspec URL elsewhere).

Local disks (fsspec protocol ``file`` / ``local``) support atomic rename: files are fsynced when
written and directories after entries are renamed into them. Other stores (``memory://``, object
stores) have no atomic rename; there :meth:`Storage.write_atomic` is a plain write (object stores
make a file visible only when its upload completes) and no fsync is needed or possible, and
:meth:`Storage.create_exclusive` is the store's conditional create (S3: ``If-None-Match: *``).

Object stores are opened with fsspec's listings cache off (``use_listings_cache=False`` unless the
caller's ``storage_options`` say otherwise): a model dir is shared by processes (trainer, sidecar,
tools) that must see each other's writes, and a cached listing would hide them.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import posixpath
import secrets
import stat
import time
from typing import IO, Any, Iterator

import fsspec.core

__all__ = ["LOCAL_PROTOCOLS", "Storage", "is_plain_path", "is_url", "local_path"]

LOCAL_PROTOCOLS = frozenset({"file", "local"})
"""The protocols of fsspec's local file system (``LocalFileSystem.protocol``): a location with one
of them is a path on this machine's disks."""
_CACHELESS_EXEMPT = frozenset({None, "file", "local", "memory"})  # no listings cache to turn off
_CONFLICT_RETRIES = 6
"""Tries of a conditional create that S3 answers with 409 ConditionalRequestConflict (another
conditional write of the same key in flight): retried after a short back-off, as AWS advises."""


def local_path(location: str) -> str | None:
    """The path on this machine's disks that ``location`` names, or None when it is a URL of another
    store: a plain path is returned as it is; a ``file://`` or ``local://`` URL (fsspec's local file
    system, which :class:`Storage` opens for both) without its protocol; ``memory://``, ``s3://``,
    chained URLs (``simplecache::s3://``) and any other protocol give None. The one place cadence
    tells a local path from a URL."""
    protocol, path = fsspec.core.split_protocol(location)
    if protocol is None:
        return location
    return path if protocol in LOCAL_PROTOCOLS else None


def _nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest ancestor that exists (a link counts as existing)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def file_on_path(location: str) -> str | None:
    """Why nothing can be created at local ``location`` because a file stands on its path (itself or
    its nearest existing ancestor is no directory), as a phrase, or None (also for a URL of another
    store). Reads only."""
    path = local_path(location)
    if path is None:
        return None
    existing = _nearest_existing(path)
    if os.path.isdir(existing):
        return None
    return f"{existing} is a file, not a directory" if os.path.isfile(existing) else f"{existing} is not a directory"


def unwritable_reason(location: str) -> str | None:
    """Why this process cannot write into local ``location`` or create it, as a phrase, or None when it
    can (and for a URL of another store, whose permissions show at the first write). Its nearest
    existing directory (itself or an ancestor) must be a directory this process may write and search:
    a file on the path (:func:`file_on_path`), a permission (root without ``CAP_DAC_OVERRIDE`` too),
    an immutable directory or a read-only file system is named. Reads only: nothing is created."""
    path = local_path(location)
    if path is None:
        return None
    on_path = file_on_path(path)
    if on_path is not None:
        return on_path
    target, existing = os.path.abspath(path), _nearest_existing(path)
    effective = os.access in os.supports_effective_ids  # root without CAP_DAC_OVERRIDE is refused too
    if os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        return None
    why = "a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "permission denied"
    return f"cannot write into it ({why})" if existing == target else f"cannot create it in {existing} ({why})"


def is_url(location: str) -> bool:
    """Whether ``location`` is a URL of a store other than the local disks (see :func:`local_path`)."""
    return local_path(location) is None


def is_plain_path(location: str) -> bool:
    """Whether ``location`` is a path with no protocol at all (not even ``file://`` / ``local://``):
    one that ``os.path`` functions may rewrite (normalise, make absolute) as they are."""
    return fsspec.core.split_protocol(location)[0] is None


def _temp_suffix() -> str:
    return f".tmp-{secrets.token_hex(6)}"


class Storage:
    """The file system behind ``url`` (a local path or an fsspec URL such as ``memory://x``).

    ``storage_options`` are passed to fsspec (credentials, endpoints, ...). :attr:`root` is the
    file-system path of ``url``; nothing is created until asked for.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.options: dict[str, Any] = dict(storage_options or {})
        options = dict(self.options)
        if fsspec.core.split_protocol(url)[0] not in _CACHELESS_EXEMPT:
            options.setdefault("use_listings_cache", False)  # other processes' writes must show (module doc)
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root: str = root.rstrip("/") or "/"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._local = bool(LOCAL_PROTOCOLS.intersection(protocols))

    def __repr__(self) -> str:
        return f"Storage({self.url(self.root)!r})"

    @property
    def atomic_rename(self) -> bool:
        """True on local disks: a rename (of a file or a directory) is atomic and durable."""
        return self._local

    # -- paths ---------------------------------------------------------------------------------

    def join(self, *parts: str) -> str:
        """A path under :attr:`root`, e.g. ``join("ckpt-5", "MANIFEST.json")``."""
        return posixpath.join(self.root, *parts)

    def url(self, path: str) -> str:
        """``path`` as users see it: an absolute local path, or an fsspec URL on other stores."""
        return path if self._local else self.fs.unstrip_protocol(path)

    # -- queries -------------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def link_under(self, path: str, top: str | None = None) -> str | None:
        """The first symbolic link on the way down from ``top`` (default :attr:`root`) to ``path``.

        Checked: each directory between ``top`` and ``path``, then ``path`` itself; ``top`` itself
        is trusted (a model dir may well live behind a link). For a ``path`` outside ``top`` only
        ``path`` itself is checked; ``path == top`` gives None. Such a link may lead anywhere,
        outside ``top`` included. Always None off local disks: object stores have no links.
        """
        if not self._local:
            return None
        top = (self.root if top is None else top).rstrip("/")
        if path.rstrip("/") == top:
            return None
        if not path.startswith(top + "/"):
            return path if os.path.islink(path) else None
        current = top
        for part in path[len(top) + 1:].split("/"):
            if part:
                current = f"{current}/{part}"
                if os.path.islink(current):
                    return current
        return None

    def entry_kind(self, path: str) -> str | None:
        """What is at ``path``: ``"link"`` (a symbolic link, never followed; local disks only),
        ``"dir"``, ``"file"``, ``"other"`` (a socket, a device, ...), or None when nothing is.
        Off local disks a path that objects live under is a ``"dir"``."""
        if self._local:
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return None
            if stat.S_ISLNK(mode):
                return "link"
            return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
        self.fs.invalidate_cache(path)
        if self.isfile(path):
            return "file"
        return "dir" if self.isdir(path) else None

    def tree(self, path: str) -> dict[str, str]:
        """Everything under the directory ``path`` (not itself), sorted: relative ``/`` path ->
        its :meth:`entry_kind`. Links are listed, never followed. Off local disks only the files are
        listed (an object store's directories are no more than their files' prefixes)."""
        out: dict[str, str] = {}
        if not self._local:
            self.fs.invalidate_cache(path)
            prefix = path.rstrip("/") + "/"
            files = self.fs.find(path, detail=False) if self.isdir(path) else []
            return {str(f)[len(prefix):]: "file" for f in sorted(files) if str(f).startswith(prefix)}

        def walk(directory: str, rel: str) -> None:
            with os.scandir(directory) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    name = rel + entry.name
                    out[name] = self.entry_kind(entry.path) or "other"
                    if out[name] == "dir":
                        walk(entry.path, name + "/")

        if self.entry_kind(path) == "dir":
            walk(path, "")
        return dict(sorted(out.items()))

    def listdir(self, path: str) -> list[str]:
        """Base names of the entries of directory ``path``; empty when it does not exist.

        Listing caches are dropped first, so a poller sees entries written by other processes.
        """
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(str(entry).rstrip("/")) for entry in entries)
        return sorted(name for name in names if name)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def mtime(self, path: str) -> float | None:
        """Modification time (unix seconds), or None where the store does not say."""
        try:
            return float(self.fs.modified(path).timestamp())
        except (NotImplementedError, AttributeError, OSError, ValueError, TypeError):
            return None

    def read_bytes(self, path: str) -> bytes:
        """The whole file. Raises ``FileNotFoundError`` when it does not exist."""
        if self._local:
            with open(path, "rb") as f:
                return f.read()
        return bytes(self.fs.cat_file(path))

    def read_view(self, path: str, limit: int | None = None, *, follow_link: bool = True) -> memoryview:
        """A read-only view of the file's bytes: all of them, or the first ``limit``.

        A local file is memory-mapped (read-only, shared with the page cache): nothing is copied
        until the bytes are used, and a file already in the page cache costs no read at all. The
        mapping lives as long as the view (or anything made from it). A file truncated by someone
        else while mapped would fault (SIGBUS) when read past its new end; checkpoint files are
        never changed in place (they are replaced by new directories). ``follow_link=False``
        refuses a local ``path`` that is a symbolic link when it is opened (``OSError`` ELOOP), so
        a link swapped in after a check is not followed either. Other stores: the bytes are read.
        Raises ``FileNotFoundError`` when it does not exist.
        """
        if not self._local:
            data = self.fs.cat_file(path, start=0, end=limit) if limit is not None else self.fs.cat_file(path)
            return memoryview(bytes(data))
        fd = os.open(path, os.O_RDONLY | (0 if follow_link else os.O_NOFOLLOW))
        try:
            size = os.fstat(fd).st_size
            length = size if limit is None else min(size, limit)
            if length == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fd, length, access=mmap.ACCESS_READ))
        finally:
            os.close(fd)

    # -- writes --------------------------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, path: str, *, fsync: bool = True) -> Iterator[IO[bytes]]:
        """A binary stream creating (or replacing) ``path``; on local disks fsynced on success."""
        if self._local:
            with open(path, "wb") as f:
                yield f
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        else:
            with self.fs.open(path, "wb") as f:
                yield f

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview, *, fsync: bool = True) -> None:
        """Create (or replace) ``path`` with ``data``; not atomic (see :meth:`write_atomic`)."""
        with self.open_write(path, fsync=fsync) as f:
            f.write(data)

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[IO[bytes]]:
        """A binary stream that replaces ``path`` all at once when the block ends without error.

        Local disks: a temp file in the same directory, fsync, rename over ``path``, fsync the
        directory -- readers see the old file or the new one, never a part; on an error the temp
        file is removed and ``path`` is untouched. Elsewhere a plain write.
        """
        if not self._local:
            with self.open_write(path) as f:
                yield f
            return
        temp = path + _temp_suffix()
        try:
            with self.open_write(temp, fsync=True) as f:
                yield f
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temp)
            raise
        self.fsync_dir(posixpath.dirname(path))

    def write_atomic(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Replace ``path`` by ``data`` all at once (see :meth:`open_atomic`)."""
        with self.open_atomic(path) as f:
            f.write(data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; True when this call created it.

        Of processes racing to create one path, exactly one gets True. Local disks: the data is
        written and fsynced to a temp file that is then hard-linked to ``path`` (``link`` fails
        when ``path`` exists), so the file is never seen partly written. Other stores: their
        ``"xb"`` mode, a conditional create where the store has one (``memory://``; S3's
        ``PutObject`` with ``If-None-Match: *`` through s3fs, the store answering 412 when the
        object exists; a 409 ``ConditionalRequestConflict`` -- a concurrent conditional write of
        the key -- is retried). A store without one falls back to check-then-write, which is not
        atomic: fsspec refusing ``"xb"`` (``ValueError`` / ``NotImplementedError``) or the store
        answering 501 Not Implemented (``ENOSYS``). An S3-compatible store that ignores the
        header overwrites: there both racers get True, and only the writer lease keeps writers
        apart.
        """
        if self._local:
            temp = path + _temp_suffix()
            self.write_bytes(temp, data, fsync=True)
            try:
                os.link(temp, path)
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.remove(temp)
            self.fsync_dir(posixpath.dirname(path))
            return True
        for attempt in range(_CONFLICT_RETRIES):
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(data)
                return True
            except FileExistsError:
                return False
            except (ValueError, NotImplementedError):
                break
            except OSError as e:
                if e.errno == errno.ENOSYS:
                    break
                if _error_code(e) != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES - 1:
                    raise
                time.sleep(0.05 * 2**attempt)
        if self.exists(path):
            return False
        self.write_bytes(path, data)
        return True

    def rename(self, src: str, dst: str, *, sync: bool = True) -> None:
        """Move a file or directory; atomic and durable (parent fsynced) on local disks only.

        On local disks a non-empty directory ``dst`` makes this fail rather than be replaced.
        ``sync=False``: the parents are not fsynced; the caller makes the move durable
        (:meth:`fsync_dir`), e.g. together with others.
        """
        if self._local:
            os.rename(src, dst)
            if not sync:
                return
            self.fsync_dir(posixpath.dirname(dst))
            if posixpath.dirname(src) != posixpath.dirname(dst):
                self.fsync_dir(posixpath.dirname(src))
        else:
            self.fs.mv(src, dst, recursive=True)

    def remove(self, path: str) -> None:
        """Delete a file; a symbolic link is removed itself, never its target.

        Raises ``FileNotFoundError`` when it does not exist, and ``OSError`` when a directory
        between :attr:`root` and ``path`` is a link (see :meth:`_check_no_link_above`).
        """
        if self._local:
            self._check_no_link_above(path)
            os.remove(path)
        else:
            self.fs.rm_file(path)

    def rmtree(self, path: str) -> None:
        """Delete a directory and everything under it; nothing happens when it does not exist.

        Links are never followed: a ``path`` that is a symbolic link is removed itself (its
        target is untouched), links inside the tree are removed as links; ``OSError`` when a
        directory between :attr:`root` and ``path`` is a link (see :meth:`_check_no_link_above`).
        """
        if self._local:
            self._check_no_link_above(path)
            if os.path.islink(path):
                os.remove(path)
                return
        if self.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_empty_dir(self, path: str) -> bool:
        """Delete directory ``path`` only when it is empty (never a link, never what is in one);
        True when it was removed, False when it is not there, not empty, or not a directory.
        Object stores, where a directory is a prefix that ends with its last object, remove only
        a store's own empty directory (``memory://``), never a bucket."""
        if self._local:
            self._check_no_link_above(path)
            if os.path.islink(path) or not os.path.isdir(path):
                return False
            try:
                os.rmdir(path)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    return False
                raise
            return True
        stripped = path.strip("/")
        if "/" not in stripped or not self.isdir(path) or self.listdir(path):
            return False
        self.fs.rmdir(path)
        return True

    def _check_no_link_above(self, path: str) -> None:
        """Raise ``OSError`` when a directory between :attr:`root` and ``path`` is a symbolic link:
        deleting through it would delete what it points to, maybe outside the root."""
        parent = posixpath.dirname(path)
        link = self.link_under(parent) if parent.startswith(self.root.rstrip("/") + "/") else None
        if link is not None:
            raise OSError(f"refusing to delete {path}: {link} is a symbolic link (it may lead outside {self.root})")

    def fsync_file(self, path: str) -> None:
        """Make a written file's data durable (another descriptor of the same file will do); a no-op
        off local disks, where a file is complete once its stream is closed."""
        if self._local:
            _fsync_path(path)

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries (creations, renames) durable; a no-op off local disks."""
        if self._local and os.name != "nt":
            _fsync_path(path)


def _error_code(error: BaseException) -> str | None:
    """The S3 error code behind an ``OSError`` s3fs translated from a botocore ``ClientError``."""
    response = getattr(error.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
