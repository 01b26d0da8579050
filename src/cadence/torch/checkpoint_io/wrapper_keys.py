"""State-dict keys written through a wrapper: ``torch.compile``'s ``OptimizedModule`` puts
``_orig_mod.`` into every key of what it wraps, DDP / DataParallel put ``module.`` in front of all.

cadence never writes such keys (it saves the unwrapped module's state, and ``trainer.compile``
compiles in place); a file written by another tool may hold them. :func:`match_saved_keys`
renames them to the model's keys when that is what makes them match, as torchtune's state-dict
hook strips ``_orig_mod.``.
"""

from __future__ import annotations

from typing import Collection, Mapping, TypeVar

__all__ = ["COMPILE_PREFIX", "PARALLEL_PREFIX", "match_saved_keys", "unwrapped_key"]

V = TypeVar("V")

COMPILE_PREFIX = "_orig_mod."
"""What ``torch.compile(module)`` adds in front of the keys of ``module`` (at any depth)."""
PARALLEL_PREFIX = "module."
"""What DistributedDataParallel / DataParallel add in front of every key."""


def unwrapped_key(key: str, *, parallel: bool) -> str:
    """``key`` without ``_orig_mod.`` components (anywhere) and, when ``parallel``, without the
    leading ``module.`` ones."""
    parts = [part for part in key.split(".") if part != COMPILE_PREFIX[:-1]]
    if parallel:
        while len(parts) > 1 and parts[0] == PARALLEL_PREFIX[:-1]:
            parts.pop(0)
    return ".".join(parts)


def match_saved_keys(saved: Mapping[str, V], expected: Collection[str]) -> dict[str, V]:
    """``saved`` as it is when it has no key the model lacks; else ``saved`` with its wrapper
    prefixes stripped (``module.`` only when every key has it), when that matches more of the
    model's keys and keeps the keys distinct. What still does not match is the caller's to report."""
    wanted = set(expected)
    if all(key in wanted for key in saved):
        return dict(saved)
    parallel = bool(saved) and all(key.startswith(PARALLEL_PREFIX) for key in saved)
    renamed = {unwrapped_key(key, parallel=parallel): value for key, value in saved.items()}
    if len(renamed) != len(saved):  # two keys would become one: not a wrapper's doing
        return dict(saved)
    if sum(key in wanted for key in renamed) <= sum(key in wanted for key in saved):
        return dict(saved)
    return renamed
