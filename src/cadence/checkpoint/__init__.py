"""Framework-agnostic checkpoints: atomic commits, manifests, retention, verified restore.

Nothing here imports torch; ``cadence.torch`` provides checkpointable wrappers for models and
optimizers. See :class:`CheckpointManager` for the contract and docs/design.md for the on-disk layout.
"""

from cadence.checkpoint.copy import JSONState, copy_objects
from cadence.checkpoint.lease_file import Lease
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.checkpoint.leases import Leases
from cadence.checkpoint.final import FINAL_NAME
from cadence.checkpoint.manager import CheckpointManager
from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.checkpoint.files import STATE_NAME
from cadence.checkpoint.protocol import (
    Checkpointable,
    CheckpointReader,
    CheckpointWriter,
    Restorable,
    Savable,
    Snapshottable,
)
from cadence.storage import Storage

__all__ = [
    "CheckpointManager",
    "Checkpointable",
    "CheckpointReader",
    "CheckpointWriter",
    "FINAL_NAME",
    "JSONState",
    "Lease",
    "LeaseKeeper",
    "Leases",
    "MANIFEST_NAME",
    "Restorable",
    "Savable",
    "Snapshottable",
    "STATE_NAME",
    "Storage",
    "copy_objects",
]
