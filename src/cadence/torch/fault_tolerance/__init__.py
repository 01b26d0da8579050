"""Fault-tolerant replica groups on torchft (``trainer.fault_tolerance``): the torchft ``Manager`` a
group joins (``manager``), the state a healing group takes from a live peer (``healing``), and the
per-step quorum, gradient average and commit vote the trainer runs (``step_sync``). torchft is
imported here only (the ``ft`` extra)."""

from cadence.torch.fault_tolerance.step_sync import ReplicaSync, join_replica_groups

__all__ = ["ReplicaSync", "join_replica_groups"]
