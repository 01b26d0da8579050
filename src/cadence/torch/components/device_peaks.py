"""Peak FLOP/s of common GPUs, for model FLOP utilisation (MFU): a table and its lookup.

Dense (no structured sparsity) tensor-core peaks per GPU at boost clock, from NVIDIA's datasheets
and architecture whitepapers (the sparse figures they print are halved); ``fp32`` is the plain
(non-tensor-core) rate. These are upper bounds that only thick matmuls approach. A GPU that is not
here, or a number you want otherwise, is set with ``trainer.peak_tflops``.
"""

from __future__ import annotations

import re

__all__ = ["PEAK_TFLOPS", "chip_of", "peak_flops", "precision_key"]

# TFLOP/s per GPU: fp32 (no tensor cores), tf32, bf16 and fp16 (tensor cores, fp32 accumulate).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Hopper (H100 / H200 / GH200 datasheets)
    "h100 sxm": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "h100 pcie": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "h100 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "h200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "h200 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "gh200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # Ada (L4 / L40 / L40S datasheets, Ada whitepaper)
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "l40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0},
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "rtx 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    # Ampere (A100 / A10 datasheets, GA102 whitepaper; A10G: AWS's variant, no NVIDIA datasheet)
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "a10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "a10g": {"fp32": 31.5, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0},
    "rtx 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    # Volta and Turing: no bf16 nor tf32 tensor cores
    "v100 sxm": {"fp32": 15.7, "fp16": 125.0},
    "v100 pcie": {"fp32": 14.0, "fp16": 112.0},
    "v100s pcie": {"fp32": 16.4, "fp16": 130.0},
    "t4": {"fp32": 8.1, "fp16": 65.0},
}

# (pattern on the lower-cased device name, chip): the first match wins, so variants come first.
_CHIPS: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), chip) for p, chip in (
    (r"gh200", "gh200"),
    (r"h200.*nvl", "h200 nvl"),
    (r"h200", "h200"),
    (r"h100.*nvl", "h100 nvl"),
    (r"h100.*(pcie|hbm2e)", "h100 pcie"),
    (r"h100", "h100 sxm"),  # "NVIDIA H100 80GB HBM3"
    (r"a100", "a100"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"v100s", "v100s pcie"),
    (r"v100.*pcie", "v100 pcie"),
    (r"v100", "v100 sxm"),
    (r"\bt4\b", "t4"),
    (r"rtx 4090", "rtx 4090"),
    (r"rtx 3090(?! ti)", "rtx 3090"),
))


def chip_of(device_name: str) -> str | None:
    """The :data:`PEAK_TFLOPS` key of a CUDA device name (``torch.cuda.get_device_name()``,
    e.g. ``"NVIDIA H100 80GB HBM3"`` -> ``"h100 sxm"``); ``None`` for a device not in the table."""
    name = device_name.lower()
    for pattern, chip in _CHIPS:
        if pattern.search(name):
            return chip
    return None


def precision_key(precision: str, *, tf32: bool) -> str:
    """The column of :data:`PEAK_TFLOPS` a run's matmuls use: ``"bf16"`` / ``"fp16"`` for those
    precisions (``trainer.precision``), and for ``"32"`` ``"tf32"`` when float32 matmuls may use
    TF32 (``tf32``), else ``"fp32"``."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if tf32 else "fp32"


def peak_flops(device_name: str, precision: str, *, tf32: bool = False) -> float | None:
    """The peak FLOP/s of one device named ``device_name`` at ``precision`` (``"32"``, ``"bf16"``
    or ``"fp16"``; with ``tf32`` float32 matmuls may use TF32 where the chip has it); ``None`` when
    the device is not in the table or lacks that precision (bf16 on a V100 or T4)."""
    chip = chip_of(device_name)
    if chip is None:
        return None
    peaks = PEAK_TFLOPS[chip]
    key = precision_key(precision, tf32=tf32)
    tflops = peaks.get(key, peaks.get("fp32") if key == "tf32" else None)
    return None if tflops is None else tflops * 1e12
