"""Numeric precision of training and evaluation: ``"32"``, ``"bf16"`` or ``"fp16"``."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import ContextManager

import torch

_ALIASES = {
    "32": "32", "fp32": "32", "float32": "32", "32-true": "32",
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16",
    "fp16": "fp16", "16": "fp16", "float16": "fp16", "16-mixed": "fp16",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved precision: ``name`` is ``"32"``, ``"bf16"`` or ``"fp16"``.

    ``autocast()`` is a fresh autocast context (a no-op for ``"32"``); ``make_grad_scaler()``
    returns a ``torch.amp.GradScaler`` for ``"fp16"`` and ``None`` otherwise.
    """

    name: str
    device_type: str
    dtype: torch.dtype | None

    def autocast(self) -> ContextManager[object]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type)


def resolve_precision(precision: str, device: torch.device | str) -> Precision:
    """Check that ``precision`` runs on ``device``.

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` (naming the precision and the
    device) when autocast to that dtype is not supported there.
    """
    name = _ALIASES.get(str(precision).lower())
    if name is None:
        raise ValueError(f"unknown precision {precision!r}: use '32', 'bf16' or 'fp16'")
    device_type = torch.device(device).type
    if name == "32":
        return Precision(name, device_type, None)
    dtype = _DTYPES[name]
    unsupported = RuntimeError(
        f"precision {precision!r} ({dtype}) is not supported on device type {device_type!r} "
        f"by this torch build ({torch.__version__}); use precision '32'"
        + (" or 'bf16'" if name == "fp16" else "")
    )
    if not torch.amp.is_autocast_available(device_type):
        raise unsupported
    if device_type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
        raise unsupported
    # torch warns and silently disables autocast for an unsupported dtype: turn that into an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            with torch.autocast(device_type=device_type, dtype=dtype):
                pass
        except (UserWarning, RuntimeError) as e:
            raise unsupported from e
    if name == "fp16":
        try:
            torch.amp.GradScaler(device_type)
        except (RuntimeError, ValueError, AssertionError) as e:  # pragma: no cover - depends on build
            raise unsupported from e
    return Precision(name, device_type, dtype)
