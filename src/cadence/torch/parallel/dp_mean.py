"""The mean of a per-rank value over the data-parallel ranks (the logged training ``loss``).

The mean is over the whole world (the default group). On a device mesh with tensor parallelism
(``trainer.parallel.tp``) that is the data-parallel mean too: the ranks of one TP group read the
same batch and compute the same loss, so each data-parallel rank's value counts ``tp`` times, as
every other's. A mesh with dimensions whose ranks differ in the loss (context parallelism) will
point :func:`dp_group` at its data-parallel group; nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.torch.runtime.context import Context

__all__ = ["dp_group", "mean_over_dp_ranks"]


def dp_group(ctx: Context) -> Any | None:
    """The process group of ``ctx``'s data-parallel ranks (``None``: the default group, all ranks)."""
    return None


def mean_over_dp_ranks(value: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Collective (every data-parallel rank calls it at the same point): the mean of the 0-d
    float ``value`` over the data-parallel ranks, each weighted equally (each holds an equal share
    of the global batch); ``value`` itself on one process. On ``value``'s device; ``value`` is
    not changed."""
    if ctx.world_size == 1:
        return value
    import torch.distributed as dist

    ctx.require_process_group("the mean of the loss over the ranks")
    total = value.detach().clone()
    group = dp_group(ctx)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / dist.get_world_size(group)
