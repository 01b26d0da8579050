"""The checksums a manifest records: which algorithms exist, how each is computed and written.

A manifest entry names its algorithm by its key: ``{"size": 123, "crc32c": "1a2b3c4d"}``. The
default, CRC32C, runs at memory speed from a native package (``crc32c``, hardware CRC instructions)
and is the checksum S3 and GCS compute natively, so a remote store can check the same value.
``xxh3_128`` (``xxhash``) is as fast; ``sha256`` (hashlib) is the cryptographic choice, and the only one of manifests written
before version 2, which keep verifying. A checksum catches truncation and corruption; none of them
is a signature.

Every algorithm here updates in pieces (:class:`Checksum`). CRC32C and SHA-256 release the GIL
on large buffers, so a checksum on a helper thread runs beside the training thread and the writes
(``google-crc32c`` was measured not to release it; ``crc32c`` does, and runs at 11 GiB/s here).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal, Protocol, get_args

import crc32c
import xxhash

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Algorithm", "Checksum", "checksum_of", "digest_problem", "new"]

Algorithm = Literal["crc32c", "xxh3_128", "sha256"]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
"""The algorithms a manifest may name, in order of preference."""

DEFAULT_ALGORITHM: Algorithm = "crc32c"
"""What new checkpoints use unless told otherwise (``checkpoint.checksum``)."""

_HEX_DIGITS = {"crc32c": 8, "xxh3_128": 32, "sha256": 64}


class Checksum(Protocol):
    """A running checksum: feed it bytes in order, read the hex digest at the end."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


class _Crc32c:
    """CRC32C (Castagnoli, as S3 and GCS compute it); the digest is the 32-bit value in hex."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = crc32c.crc32c(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new(algorithm: str) -> Checksum:
    """A fresh :class:`Checksum` of ``algorithm``. Raises ``ValueError`` naming the known ones."""
    if algorithm == "crc32c":
        return _Crc32c()
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")


def checksum_of(algorithm: str, data: bytes | bytearray | memoryview) -> str:
    """The hex digest of ``data`` (one call)."""
    checksum = new(algorithm)
    checksum.update(data)
    return checksum.hexdigest()


def digest_problem(algorithm: str, digest: object) -> str | None:
    """Why ``digest`` is not a well-formed ``algorithm`` digest (lowercase hex of its length), or None."""
    digits = _HEX_DIGITS.get(algorithm)
    if digits is None:
        return f"unknown checksum algorithm {algorithm!r}"
    if not isinstance(digest, str) or not re.fullmatch(f"[0-9a-f]{{{digits}}}", digest):
        return f"bad {algorithm} {digest!r} (expected {digits} lowercase hex digits)"
    return None
