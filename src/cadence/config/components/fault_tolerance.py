"""``trainer.fault_tolerance``: fault-tolerant replica groups coordinated by torchft's lighthouse.
Each group is a ``cadence train`` job of its own; a lost group costs the others the step in flight,
and a restarted group heals from a live peer (:mod:`cadence.torch.fault_tolerance`). Absent: nothing
changes (exact resume from the model dir stays the only recovery)."""

from __future__ import annotations

from pydantic import Field, model_validator

from cadence.config.base import ConfigModel

__all__ = ["FaultToleranceConfig", "REPLICA_ID_ENV", "LIGHTHOUSE_ENV"]

REPLICA_ID_ENV = "CADENCE_REPLICA_ID"
"""The environment variable that gives a group its ``replica_id`` when the config does not."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the lighthouse's address (``http://host:port``), read when ``lighthouse`` is null."""


class FaultToleranceConfig(ConfigModel):
    """R replica groups, each of one process or of several ranks (DDP, FSDP or a mesh inside), their
    gradients averaged over the groups that take part in each step (torchft's `Manager` over gloo).
    `cadence launch --replicas R [--nproc N]` starts the lighthouse and the groups on one machine;
    across machines, start each group with its `replica_id` (or `CADENCE_REPLICA_ID`) and the
    lighthouse's address."""

    replica_groups: int = Field(ge=1, strict=True, description="The number of replica groups (R).")
    min_replicas: int = Field(
        default=1, ge=1, strict=True,
        description=("The fewest groups a step commits with (torchft's `min_replica_size`; the lighthouse's "
                     "`--min_replicas`). 1: the survivors go on when a group is lost."))
    replica_id: int | None = Field(
        default=None, ge=0, strict=True,
        description=(f"This group's id, 0 to R-1; null: from `{REPLICA_ID_ENV}`. Group 0 takes the writer lease "
                     "first; the group holding it commits the checkpoints."))
    lighthouse: str | None = Field(
        default=None, description=f"The lighthouse's address, `http://host:port`; null: from `{LIGHTHOUSE_ENV}`.")
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a group waits for the lighthouse before it fails (exit 2).")
    timeout_s: float = Field(
        default=30.0, gt=0, description="The timeout of each collective, commit vote and healing transfer.")
    quorum_timeout_s: float = Field(
        default=60.0, gt=0, description="How long a step waits for its quorum of groups.")
    join_timeout_s: float = Field(
        default=1.0, gt=0,
        description=("The lighthouse's wait for late groups before it forms a quorum without them "
                     "(`cadence launch --replicas` passes it as `--join_timeout_ms`)."))
    heartbeat_timeout_s: float = Field(
        default=1.0, gt=0,
        description=("How long the lighthouse counts a silent group as alive (`--heartbeat_timeout_ms`; torchft's "
                     "own default is 5 s). With 2 groups the survivor waits this long after a loss: a quorum needs "
                     "more than half of the groups the lighthouse counts as alive (torchft's split-brain rule). "
                     "Groups beat every 100 ms from torchft's native manager thread, not from the training step, "
                     "so a slow step does not make a group look lost; raise it where the network pauses."))

    @model_validator(mode="after")
    def _check_counts(self) -> FaultToleranceConfig:
        if self.min_replicas > self.replica_groups:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds replica_groups ({self.replica_groups})")
        if self.replica_id is not None and self.replica_id >= self.replica_groups:
            raise ValueError(f"replica_id {self.replica_id} is not below replica_groups ({self.replica_groups})")
        return self
