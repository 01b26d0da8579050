"""The file of one reader's lease, ``checkpoints/.leases/<holder>.json``, and the clocks that judge it.

::

    {"holder": "eval", "after": 200, "reading": 200, "max_pending": null,
     "expires": 1700000060.0, "pid": 1234, "host": "node-3", "time": 1700000000.0}

What a lease protects, and the protocol between readers and the writer: :mod:`cadence.checkpoint.leases`.

Clocks. ``expires`` is the reader's wall clock; the writer compares it with its own. A lease
written on another host (its ``host`` differs from this one's name) counts
:data:`CLOCK_SKEW_TOLERANCE` seconds longer (:func:`clock_skew`), and a reader renews every
``ttl / 4``: so a reader's clock may lag the writer's by up to ``3/4 ttl`` + that tolerance
before its lease lapses while it lives. Same host, same clock: no tolerance.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Iterable

LEASES_DIR = ".leases"
"""The directory (inside the checkpoints directory) holding the lease files; not a checkpoint."""

_HOLDER = re.compile(r"[A-Za-z0-9_.-]+")
_SUFFIX = ".json"

CLOCK_SKEW_TOLERANCE = 10.0
"""Seconds by which the wall clocks of two hosts sharing a model dir may differ: an expiry time
written on another host is trusted only this much later (readers' leases here, the writer lease
in :mod:`cadence.checkpoint.writer_lease`)."""


def clock_skew(host: str) -> float:
    """The tolerance to add to an expiry time written on ``host``: 0 for this host (one clock),
    :data:`CLOCK_SKEW_TOLERANCE` for any other, or an unknown (``""``) one."""
    return 0.0 if host and host == socket.gethostname() else CLOCK_SKEW_TOLERANCE


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (Linux: state ``Z`` in ``/proc/<pid>/stat``):
    a killed holder whose parent died too stays one until init reaps it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) state ...": the command may hold spaces and parentheses; the state follows the last ")".
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"Z"


def process_ended(host: str, pid: int) -> bool:
    """True when process ``pid`` of ``host`` is known to have ended: ``host`` is this machine and no
    process ``pid`` runs (or only its zombie). A process of another host, or an unknown one (``host``
    empty, ``pid <= 0``), is never known to have ended."""
    if not host or host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs, as another user
        return False
    return zombie(pid)


def check_holder(holder: object) -> str:
    """Return ``holder`` when it is a valid holder name (``[A-Za-z0-9_.-]+``), else raise ``ValueError``."""
    if not isinstance(holder, str) or not _HOLDER.fullmatch(holder):
        raise ValueError(f"a lease holder name is a non-empty string of letters, digits, '_', '.' and '-', got {holder!r}")
    return holder


def file_name(holder: str) -> str:
    """The name of ``holder``'s lease file in ``.leases/``; ``ValueError`` for a bad holder name."""
    return check_holder(holder) + _SUFFIX


def holder_of(name: str) -> str | None:
    """The holder whose lease file is called ``name``; None when ``name`` is no lease file's."""
    if not name.endswith(_SUFFIX):
        return None
    holder = name[: -len(_SUFFIX)]
    return holder if _HOLDER.fullmatch(holder) else None


def check_reading(value: object) -> int | None:
    """A lease's ``reading``: None or an int >= 0; else ``ValueError``."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"lease reading must be None or an int >= 0, got {value!r}")
    return value


def check_after(value: object) -> int | None:
    """A lease's ``after``: None or an int >= -1; else ``ValueError``."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"lease after must be None or an int >= -1 (-1: every step), got {value!r}")
    return value


def check_max_pending(value: object) -> int | None:
    """A lease's ``max_pending``: None or an int >= 1; else ``ValueError``."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"lease max_pending must be None or an int >= 1, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """``value`` (called ``name`` in the error) as a float when it is a finite number > 0; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Lease:
    """One reader's lease, as read from (or written to) ``.leases/<holder>.json``.

    Attributes:
      holder: the reader's name (also the file name).
      after: protect every step ``> after`` (-1: every step); None: no range.
      reading: protect this step; None: none.
      max_pending: with ``after``, protect only the newest ``max_pending`` steps ``> after``;
        None: all of them (the last field, with a default: files and callers without it still work).
      expires: unix time (the writer's clock decides) after which the lease protects nothing.
      pid, host: the process that wrote it (for people and tools; a reader starting under the same
        holder name uses them only to tell a holder that died on this machine from a live one:
        :meth:`cadence.checkpoint.leases.Leases.held_elsewhere`).
      time: unix time of the write.
    """

    holder: str
    after: int | None
    reading: int | None
    expires: float
    pid: int
    host: str
    time: float
    max_pending: int | None = None

    def protects(self, steps: Iterable[int]) -> set[int]:
        """The steps among ``steps`` this lease protects: ``reading``, and those ``> after`` (only
        the newest ``max_pending`` of them when it is set).

        Expiry is not considered here (see :meth:`expired` and
        :meth:`cadence.checkpoint.leases.Leases.active`).
        """
        steps = set(steps)
        protected = {self.reading} & steps if self.reading is not None else set()
        if self.after is not None:
            later = sorted(step for step in steps if step > self.after)
            if self.max_pending is not None:
                later = later[-self.max_pending :]
            protected.update(later)
        return protected

    def expired(self, now: float) -> bool:
        """True when the lease has ended at unix time ``now`` (``now >= expires``)."""
        return now >= self.expires

    def to_json(self) -> bytes:
        """The file's contents."""
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, holder: str) -> Lease:
        """Parse a lease file's contents; ``holder`` is the file's holder name (authoritative).

        ``after``, ``reading`` and ``expires`` must be valid (they decide what is protected), and
        ``max_pending`` when present; missing or mistyped ``pid`` / ``host`` / ``time`` are filled with 0 / "" / 0.0.
        Raises ``ValueError`` on anything else.
        """
        document = json.loads(data)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        for key in ("after", "reading", "expires"):
            if key not in document:
                raise ValueError(f"no {key!r}")
        expires = document["expires"]
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise ValueError(f"'expires' is not a finite number: {expires!r}")
        pid, host, when = document.get("pid"), document.get("host"), document.get("time")
        return cls(
            holder=holder,
            after=check_after(document["after"]),
            reading=check_reading(document["reading"]),
            max_pending=check_max_pending(document.get("max_pending")),
            expires=float(expires),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
            host=host if isinstance(host, str) else "",
            time=float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else 0.0,
        )
