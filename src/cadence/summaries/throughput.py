"""Throughput of the training loops: what a trainer counts in one loop (:class:`LoopWork`), the
rates the controller logs from it (:func:`throughput_logs`), and the names they are logged under.

The controller times each ``trainer.train(n)`` call; a trainer that is :class:`CountsWork` then
says what that call processed, and the rates come from the same elapsed time as
``steps_per_second`` (so ``samples_per_second / steps_per_second`` is the samples per step).
No framework is imported here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Protocol, runtime_checkable

__all__ = ["CountsWork", "LoopWork", "MEMORY_KEYS", "MFU", "MODEL_TFLOPS_PER_SECOND", "PEAK_ALLOCATED_GIB",
           "PEAK_RESERVED_GIB", "RATE_KEYS", "SAMPLES_PER_SECOND", "TOKENS_PER_SECOND", "format_throughput",
           "throughput_logs"]

SAMPLES_PER_SECOND = "samples_per_second"
"""Samples (examples) trained per second, over all ranks."""
TOKENS_PER_SECOND = "tokens_per_second"
"""Tokens trained per second, over all ranks (when the task counts tokens: ``Task.tokens_per_batch``)."""
MODEL_TFLOPS_PER_SECOND = "model_tflops_per_second"
"""The model's training FLOPs (forward + backward) achieved per second, per device, in TFLOP/s."""
MFU = "mfu"
"""Model FLOP utilisation: ``model_tflops_per_second`` / the device's peak (a fraction, 0.42 is 42%)."""
PEAK_ALLOCATED_GIB = "memory/peak_allocated_gib"
"""CUDA: the most memory held by tensors during the loop, GiB (``torch.cuda.max_memory_allocated``)."""
PEAK_RESERVED_GIB = "memory/peak_reserved_gib"
"""CUDA: the most memory reserved by the caching allocator during the loop, GiB."""

RATE_KEYS = (SAMPLES_PER_SECOND, TOKENS_PER_SECOND, MODEL_TFLOPS_PER_SECOND, MFU)
MEMORY_KEYS = (PEAK_ALLOCATED_GIB, PEAK_RESERVED_GIB)


@dataclasses.dataclass(frozen=True)
class LoopWork:
    """What one ``train()`` call processed on this rank.

    ``samples`` / ``tokens``: counted over every batch (micro-batch) the call ran; ``None``: not
    counted. ``world_size``: the ranks training in lockstep, each on as many samples (the global
    rates are this rank's times ``world_size``: no collective). ``flops_per_sample``: training FLOPs
    (forward + backward) of one sample; ``peak_flops``: the device's peak FLOP/s; ``None``: unknown.
    ``shared_by``: the ranks that process each sample together (the tensor-parallel degree): a
    sample counts once in the rates, and each of them does its share of the sample's FLOPs.
    """

    samples: int | None = None
    tokens: int | None = None
    world_size: int = 1
    flops_per_sample: float | None = None
    peak_flops: float | None = None
    shared_by: int = 1


@runtime_checkable
class CountsWork(Protocol):
    """A trainer that says what its last ``train()`` call processed (called once after each)."""

    def loop_work(self) -> LoopWork: ...


def throughput_logs(work: LoopWork, elapsed: float) -> dict[str, float]:
    """The rates of ``work`` done in ``elapsed`` seconds: :data:`SAMPLES_PER_SECOND` and
    :data:`TOKENS_PER_SECOND` (global), :data:`MODEL_TFLOPS_PER_SECOND` (per device) when the
    FLOPs per sample are known, :data:`MFU` when the peak is known too. Only what is known; ``{}``
    for a non-positive ``elapsed``."""
    if not elapsed > 0:
        return {}
    logs: dict[str, float] = {}
    if work.samples is not None:
        logs[SAMPLES_PER_SECOND] = work.samples * work.world_size / work.shared_by / elapsed
    if work.tokens is not None:
        logs[TOKENS_PER_SECOND] = work.tokens * work.world_size / work.shared_by / elapsed
    if work.samples is not None and work.flops_per_sample is not None:
        achieved = work.flops_per_sample * work.samples / work.shared_by / elapsed  # this device's FLOP/s
        logs[MODEL_TFLOPS_PER_SECOND] = achieved / 1e12
        if work.peak_flops is not None and work.peak_flops > 0:
            logs[MFU] = achieved / work.peak_flops
    return logs


def _si(value: float) -> str:
    """``value`` with 3 significant digits and a k / M / G suffix: ``"512"``, ``"12.3k"``."""
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.3g}"


def format_throughput(logs: Mapping[str, Any]) -> str:
    """The throughput entries of a loop's logs for people (the progress line):
    ``"1.23k samples/s  45.6k tokens/s  MFU 41.2%  peak mem 3.21 GiB"`` (each to 3 significant digits:
    ``MFU 0.0134%``); ``""`` when none."""
    parts = []
    for key, unit in ((SAMPLES_PER_SECOND, "samples/s"), (TOKENS_PER_SECOND, "tokens/s")):
        value = logs.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{_si(value)} {unit}")
    mfu = logs.get(MFU)
    if isinstance(mfu, (int, float)) and math.isfinite(mfu):
        parts.append(f"MFU {mfu * 100:.3g}%")
    elif isinstance(tflops := logs.get(MODEL_TFLOPS_PER_SECOND), (int, float)) and math.isfinite(tflops):
        parts.append(f"{tflops:.3g} TFLOP/s")
    memory = logs.get(PEAK_ALLOCATED_GIB)
    if isinstance(memory, (int, float)) and math.isfinite(memory):
        parts.append(f"peak mem {memory:.3g} GiB")
    return "  ".join(parts)
