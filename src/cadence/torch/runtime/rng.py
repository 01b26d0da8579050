"""The random number generators a run draws from, saved and restored for exact resume.

RNG states (Python ``random``, NumPy's legacy global RNG, torch CPU and every CUDA device) as
JSON; torch's byte states are base64-encoded. :class:`RNGSnapshot` is an in-memory copy for work
that must not move the RNGs (building a model copy, an evaluation).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import random
from typing import Any, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["RNGSnapshot", "get_rng_state", "rank_seed", "seed_everything", "set_rng_state"]

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def get_rng_state() -> dict[str, Any]:
    """The global RNG states of Python, NumPy, torch CPU and (when available) all CUDA devices, as JSON."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_internal), "gauss_next": py_gauss},
        "numpy": {
            "bit_generator": np_name,
            "keys": base64.b64encode(np.asarray(np_keys, dtype="<u4").tobytes()).decode("ascii"),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states from :func:`get_rng_state`; missing entries are left alone.

    CUDA states are restored for the devices present (a warning if the count differs); without
    CUDA they are ignored.
    """
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "numpy" in state:
        n = state["numpy"]
        keys = np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32)
        np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "torch" in state:
        torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint holds CUDA RNG states but CUDA is not available: not restored")
        else:
            n_dev = torch.cuda.device_count()
            if n_dev != len(cuda):
                log.warning("checkpoint holds %d CUDA RNG states, %d devices present", len(cuda), n_dev)
            for i, s in enumerate(cuda[:n_dev]):
                torch.cuda.set_rng_state(_unb64(s), i)


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, global_step: int) -> int:
    """A seed for a rank that has no saved RNG state: the same for the same (seed, rank, step)."""
    digest = hashlib.sha256(f"cadence-rng:{seed}:{rank}:{global_step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


class RNGSnapshot:
    """An in-memory copy of the global RNG states (cheaper than JSON), restored by ``restore()``."""

    def __init__(self) -> None:
        self._python = random.getstate()
        self._numpy = np.random.get_state()
        self._torch = torch.get_rng_state()
        # Only touch CUDA if it is already in use: querying it would initialise it.
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        random.setstate(self._python)
        np.random.set_state(self._numpy)
        torch.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
