"""The device mesh (``trainer.parallel``): degrees resolved against the world size
(:func:`resolve_degrees`, one line and exit 2 when they do not fit), the mesh built from them
(:func:`build_mesh`, torchtitan's dimension names) and a rank's data-parallel coordinates.

``trainer.strategy`` is the 1-D case: ``ddp`` is ``dp_replicate = world``, ``fsdp`` ``dp_shard = world``
(:func:`strategy_degrees`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cadence.errors import ConfigError

__all__ = ["MeshDegrees", "build_mesh", "resolve_degrees", "strategy_degrees"]


@dataclasses.dataclass(frozen=True)
class MeshDegrees:
    """Resolved degrees (every one >= 1; their product is the world size)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: each reads its own share of the data."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_1d_data_parallel(self) -> bool:
        """No TP and at most one data-parallel dimension above 1: ``trainer.strategy``'s cases."""
        return self.tp == 1 and (self.dp_replicate == 1 or self.dp_shard == 1)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (ranks are laid out dp_replicate, dp_shard, tp,
        tp the fastest: the ranks of a TP group are consecutive and share it)."""
        return rank // self.tp

    def describe(self) -> str:
        return f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"


def strategy_degrees(strategy: str, world_size: int) -> MeshDegrees:
    """``trainer.strategy``'s mesh: ``ddp`` replicates over every rank, ``fsdp`` shards over them."""
    return MeshDegrees(dp_shard=world_size) if strategy == "fsdp" else MeshDegrees(dp_replicate=world_size)


def resolve_degrees(dp_replicate: int, dp_shard: int, tp: int, world_size: int, *,
                    tp_divisor: int | None = None, has_tp_plan: bool = True, task_name: str = "the Task") -> MeshDegrees:
    """The degrees with a ``-1`` filled by the rest of ``world_size``; :class:`ConfigError` (one line)
    when their product is not ``world_size``, when ``tp > 1`` and the Task has no plan
    (``has_tp_plan``), or when ``tp`` does not divide ``tp_divisor`` (what the Task says TP splits,
    e.g. its attention heads)."""
    given = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    known = 1
    for value in given.values():
        if value != -1:
            known *= value
    fill = [name for name, value in given.items() if value == -1]
    if fill:
        if world_size % known:
            raise ConfigError(f"trainer.parallel ({shown}): the world size {world_size} (processes) does not divide by "
                              f"{known}, the product of the other degrees")
        given[fill[0]] = world_size // known
    degrees = MeshDegrees(**given)
    if degrees.world_size != world_size:
        raise ConfigError(f"trainer.parallel ({shown}): the degrees' product {degrees.world_size} is not the world "
                          f"size {world_size} (processes)")
    if degrees.tp > 1 and not has_tp_plan:
        raise ConfigError(f"trainer.parallel.tp is {degrees.tp}, but {task_name} has no tensor-parallel plan "
                          "(override Task.parallelize)")
    if degrees.tp > 1 and tp_divisor is not None and tp_divisor % degrees.tp:
        raise ConfigError(f"trainer.parallel.tp: {degrees.tp} does not divide {tp_divisor}, what {task_name} splits "
                          "over the tensor-parallel ranks (Task.tp_divisor)")
    return degrees


def build_mesh(degrees: MeshDegrees, device_type: str) -> Any:
    """A ``DeviceMesh`` of shape ``(dp_replicate, dp_shard, tp)`` named so, with the flattened
    ``dp`` dimension (data loading) and ``dp_replicate``/``dp_shard`` (FSDP's 2-D mesh). A collective:
    every rank builds it at the same point (the process group must be initialised)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (degrees.dp_replicate, degrees.dp_shard, degrees.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh
