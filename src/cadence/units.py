"""Quantities written for people: byte counts (the checkpoint space check, ``cadence ls``,
reports, the smoke run's lines). Imports nothing of cadence, so every layer may use it."""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(n: float) -> str:
    """A byte count for people: ``"512 B"``, ``"138.8 KiB"``, ``"1.2 GiB"`` (GiB the largest unit)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
