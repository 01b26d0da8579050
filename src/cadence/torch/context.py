"""Where a task runs: the device, the process's place among ranks, and the base seed."""

from __future__ import annotations

import dataclasses

import torch


def _default_device() -> torch.device:
    return torch.device("cpu")


@dataclasses.dataclass
class Context:
    """Handed to :meth:`Task.build_inputs`; shard the data with ``rank`` / ``world_size``.

    ``rank`` is the global rank among ``world_size`` processes, ``local_rank`` the rank on this
    machine (which GPU). Single-process runs use the defaults.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=_default_device)
    seed: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the process that writes checkpoints and summaries."""
        return self.rank == 0

    @classmethod
    def create(
        cls,
        device: str | torch.device = "auto",
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
    ) -> "Context":
        """A context on ``device``; ``"auto"`` picks ``cuda:<local_rank>`` when CUDA is available, else CPU."""
        if isinstance(device, str) and device == "auto":
            if torch.cuda.is_available():
                device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
            else:
                device = torch.device("cpu")
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=torch.device(device), seed=seed)
