"""A JSON value that survives restarts: :class:`JSONPersistedValue` (Orbit's, through fsspec)."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from cadence.errors import CadenceError
from cadence.storage import Storage

__all__ = ["JSONPersistedValue", "PersistedValueError"]


class PersistedValueError(CadenceError, ValueError):
    """A persisted value's file exists but cannot be read as JSON. The message names the file."""


class JSONPersistedValue:
    """A JSON-serialisable value backed by a file, so that it survives preemptions and restarts.

    The file is read once, at construction; afterwards :meth:`read` returns the value in memory and
    :meth:`write` updates both memory and file. Writes are atomic: on local disks a temp file in
    the same directory is fsynced and renamed over ``filename`` (:meth:`Storage.write_atomic`), so
    a crash leaves the old value or the new one, never a mix; on object stores the upload makes
    the file visible all at once.

    Args:
      initial_value: the value when ``filename`` is None or does not exist yet. JSON-serialisable
        (nested dicts / lists / str / numbers / bools / None).
      filename: a local path or fsspec URL (``memory://...``, ``s3://...``) holding the value as
        JSON. ``None``: the value is kept in memory only (lost on restart).
      write_value: write ``initial_value`` at construction when the file does not exist, and new
        values on :meth:`write`. ``False``: only read the file (e.g. on all but one of several
        processes sharing it); :meth:`write` then changes the value in memory only.
      storage_options: passed to fsspec (credentials, endpoints).

    Differences from Orbit, on purpose: a file that exists but is empty or not valid JSON raises
    :class:`PersistedValueError` instead of being silently reset to ``initial_value`` (a reset
    best value would let a worse model replace the best one); a persisted ``null`` is a value like
    any other; values are written as strict JSON (NaN and infinities are refused).

    Raises:
      PersistedValueError: the file exists and is empty or not valid JSON.
      TypeError, ValueError: ``initial_value`` (when written) is not JSON-serialisable.
    """

    def __init__(
        self,
        initial_value: Any,
        filename: str | None,
        write_value: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._filename = filename
        self._write_value = write_value
        self._storage: Storage | None = None
        self._path = ""
        if filename is None:
            self._value = _round_trip(initial_value)
            return
        self._storage = Storage(filename, storage_options)
        self._path = self._storage.root
        try:
            data = self._storage.read_bytes(self._path)
        except FileNotFoundError:
            self._value = None
            self.write(initial_value)
            return
        self._value = self._decode(data)

    @property
    def filename(self) -> str | None:
        """The backing file as given, or None for a memory-only value."""
        return self._filename

    def read(self) -> Any:
        """The current value (read from the file at construction, or last written)."""
        return self._value

    def write(self, value: Any) -> None:
        """Set the value and, with a filename and ``write_value``, replace the file atomically.

        The value is encoded first: a value that is not strict JSON raises (``TypeError`` /
        ``ValueError``) and changes nothing. :meth:`read` then returns the value as the file holds
        it (tuples become lists, dict keys strings), i.e. what a restarted process would read.
        """
        encoded = _encode(value)
        if self._storage is not None and self._write_value:
            parent = posixpath.dirname(self._path)
            if parent:
                self._storage.makedirs(parent)
            self._storage.write_atomic(self._path, (encoded + "\n").encode())
        self._value = json.loads(encoded)

    def _decode(self, data: bytes) -> Any:
        assert self._storage is not None
        where = self._storage.url(self._path)
        try:
            text = data.decode("utf-8")
            if not text.strip():
                raise ValueError("the file is empty")
            return json.loads(text)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise PersistedValueError(
                f"cannot read the persisted value in {where}: {e}. Fix the file, or delete it to "
                "start again from the initial value"
            ) from None

    def __repr__(self) -> str:
        return f"JSONPersistedValue({self._value!r}, filename={self._filename!r})"


def _encode(value: Any) -> str:
    return json.dumps(value, allow_nan=False)


def _round_trip(value: Any) -> Any:
    return json.loads(_encode(value))
