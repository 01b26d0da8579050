"""``trainer.parallel``: the degrees of the device mesh (data-parallel replicas, data-parallel shards,
tensor parallelism) whose product is the world size. :mod:`cadence.torch.parallel.mesh` resolves them
against the world size and builds the mesh."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from cadence.config.base import ConfigModel

__all__ = ["ParallelConfig"]

DEGREE_FORM = "-1 (the rest of the world) or an integer >= 1"


class ParallelConfig(ConfigModel):
    """The device mesh (torchtitan's `ParallelDims`): `dp_replicate` x `dp_shard` x `tp` ranks, whose product
    is the world size; one degree may be `-1`, the rest of the world. `dp_replicate > 1` alone is DDP,
    `dp_shard > 1` alone FSDP2, both HSDP (FSDP2 over the 2-D data-parallel mesh); `tp > 1` applies the
    Task's `parallelize` plan on the mesh's `tp` dimension first. The data is split over the
    data-parallel ranks only: the ranks of one TP group read the same batches. When set, it replaces
    `trainer.strategy` (`ddp` is `{dp_replicate: -1}`, `fsdp` is `{dp_shard: -1}`)."""

    dp_replicate: int = Field(default=1, strict=True, description=f"Data-parallel replicas: {DEGREE_FORM}.")
    dp_shard: int = Field(default=1, strict=True,
                          description=f"Data-parallel shards (FSDP2) within a replica: {DEGREE_FORM}.")
    tp: int = Field(default=1, strict=True, description=f"Tensor-parallel degree: {DEGREE_FORM}.")

    @field_validator("dp_replicate", "dp_shard", "tp")
    @classmethod
    def _check_degree(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"expected {DEGREE_FORM}")
        return value

    @model_validator(mode="after")
    def _check_fill(self) -> ParallelConfig:
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        fill = [name for name, value in degrees.items() if value == -1]
        if len(fill) > 1:
            raise ValueError(f"only one degree may be -1, got {' and '.join(fill)}")
        return self
