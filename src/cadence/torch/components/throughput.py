"""What a :class:`~cadence.torch.TorchTrainer` counts for the throughput summaries
(:mod:`cadence.summaries.throughput`): the samples and tokens of each loop, the peak CUDA memory, and the
training FLOPs per sample for model FLOP utilisation (MFU).

Per batch the loop pays one Python call: ``Task.batch_size_of(batch)``, plus
``Task.tokens_per_batch(batch)`` when the task overrides it; no tensor op, no host sync.

FLOPs per sample come from ``Task.flops_per_sample()``; when it returns ``None`` and a peak is
known (a GPU in :mod:`cadence.torch.components.device_peaks`' table, or ``trainer.peak_tflops``) they are
counted once, after the first loop, by :func:`count_flops_per_sample`: ``torch.utils.flop_counter``
over the forward and backward of one batch shaped as the loop's last, on a copy of the model
built on the meta device -- no real tensor is computed, and the training run is left as it was
(RNG states, the task's attributes, the model, its gradients and buffers, the data stream).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from cadence.summaries.throughput import PEAK_ALLOCATED_GIB, PEAK_RESERVED_GIB, LoopWork
from cadence.torch.data.batch import move_to_device
from cadence.torch.runtime.context import Context
from cadence.torch.components.device_peaks import peak_flops
from cadence.torch.runtime.rng import get_rng_state, set_rng_state
from cadence.torch.task.step_logs import split_output
from cadence.torch.task.task import Task

__all__ = ["ThroughputMeter", "count_flops_per_sample", "counts_tokens", "float32_matmuls_use_tf32"]

log = logging.getLogger(__name__)

_META = torch.device("meta")


def _default_size_of(task: Task) -> Any:
    """``task.batch_size_of``, with a shortcut when the task keeps the default: a batch that is a
    tensor, or a tuple / list / dict whose first entry is one, is sized without the general walk
    (the same result: dim 0 of the first tensor, 1 for a 0-d tensor)."""
    general = task.batch_size_of
    if type(task).batch_size_of is not Task.batch_size_of:
        return general
    tensor = torch.Tensor

    def size_of(batch: Any) -> int:
        first = batch
        kind = type(batch)
        if kind is tuple or kind is list:
            first = batch[0] if batch else None
        elif kind is dict:
            first = next(iter(batch.values()), None)
        if isinstance(first, tensor):
            return first.shape[0] if first.ndim else 1
        return general(batch)

    return size_of


def counts_tokens(task: Task) -> bool:
    """Whether ``task``'s class overrides :meth:`Task.tokens_per_batch` (else no tokens are counted)."""
    return type(task).tokens_per_batch is not Task.tokens_per_batch


def float32_matmuls_use_tf32() -> bool:
    """Whether float32 matmuls on CUDA may run in TF32 (``torch.set_float32_matmul_precision``
    other than ``"highest"``, or ``torch.backends.cuda.matmul.allow_tf32``)."""
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def count_flops_per_sample(task: Task, batch: Any) -> float:
    """The training FLOPs (forward + backward, as ``torch.utils.flop_counter`` counts them: the
    matmuls, convolutions and attention) of one sample of ``batch``, counted on a copy of the
    model built by ``task.build_model()`` on the meta device, with ``batch`` moved to it.

    Leaves the global RNG states (Python, NumPy, torch CPU and CUDA) and the task's attributes
    as they were (a ``build_model`` that keeps the model on the task). Raises whatever the
    counting raises (a step that needs real values: ``.item()``, data-dependent shapes), and
    ``ValueError`` when nothing was counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    rng = get_rng_state()
    attributes = dict(vars(task))
    try:
        meta_batch = move_to_device(batch, _META, non_blocking=False)
        with _META:
            model = task.build_model()
        model.train()
        with FlopCounterMode(display=False) as counter:
            loss, _ = split_output(task, task.train_step(model, meta_batch))
            loss.backward()
        flops = counter.get_total_flops()
        samples = task.batch_size_of(meta_batch)
    finally:
        vars(task).clear()
        vars(task).update(attributes)
        set_rng_state(rng)
    if not flops > 0 or not samples > 0:
        raise ValueError(f"counted {flops} FLOPs for a batch of {samples} sample(s)")
    return float(flops) / samples


class ThroughputMeter:
    """Counts a trainer's loops: :meth:`start_loop` returns the per-batch counter, the loop calls
    it with every (micro-)batch it runs, :meth:`end_loop` gives the loop's peak CUDA memory logs,
    and :meth:`loop_work` (after the loop, outside its timing) what it processed.

    ``peak_tflops``: the device's peak in TFLOP/s (``trainer.peak_tflops``); ``None``: from
    :mod:`cadence.torch.components.device_peaks` on CUDA, none on other devices. ``enabled=False``
    (``trainer.log_throughput: false``): nothing is counted, :meth:`start_loop` returns ``None``.
    Warnings are logged once, on the chief.
    """

    def __init__(self, task: Task, ctx: Context, precision: str, peak_tflops: float | None = None, *,
                 enabled: bool = True) -> None:
        if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
            raise ValueError(f"peak_tflops must be None or a positive number, got {peak_tflops!r}")
        self.task = task
        self.ctx = ctx
        self.precision = precision
        self.peak_tflops = peak_tflops
        self.enabled = enabled
        self.samples = 0
        self.tokens = 0
        self._size_of: Any = _default_size_of(task)
        self._tokens_of: Any = task.tokens_per_batch if counts_tokens(task) else None
        self._tokens_known = True
        self._last: Any = None  # the loop's last batch (its shapes, for counting FLOPs)
        self._flops_batch: Any = None  # the last loop's, until loop_work has counted the FLOPs
        self._cuda = ctx.device.type == "cuda"
        self._peak: float | None = None
        self._peak_resolved = False
        self._flops: float | None = None
        self._flops_resolved = False

    # -- the loop ------------------------------------------------------------------------------

    def start_loop(self) -> Any:
        """Reset the loop's counts (and CUDA's peak memory statistics); the per-batch counter
        (``None`` when not enabled)."""
        if not self.enabled:
            return None
        self.samples = self.tokens = 0
        self._last = None
        self._tokens_known = True
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        return self.count

    def count(self, batch: Any) -> None:
        """Count one batch: its samples (``Task.batch_size_of``) and tokens (``Task.tokens_per_batch``)."""
        self._last = batch
        if self._size_of is not None:
            try:
                self.samples += self._size_of(batch)
            except ValueError as e:  # the default batch_size_of finds no tensor in the batch
                self._size_of = None
                self._warn("no samples/s nor MFU: %s", e)
        if self._tokens_of is not None:
            n = self._tokens_of(batch)
            if n is None:
                self._tokens_known = False
            else:
                self.tokens += n

    def end_loop(self) -> dict[str, float]:
        """After the loop: the peak CUDA memory of the loop (``{}`` elsewhere). The last batch is
        kept for :meth:`loop_work` while the FLOPs are still to be counted (its shapes), else dropped."""
        if not self._flops_resolved:
            self._flops_batch = self._last
        self._last = None
        if not (self._cuda and self.enabled):
            return {}
        device = self.ctx.device
        return {PEAK_ALLOCATED_GIB: torch.cuda.max_memory_allocated(device) / 2**30,
                PEAK_RESERVED_GIB: torch.cuda.max_memory_reserved(device) / 2**30}

    def loop_work(self) -> LoopWork:
        """What the last loop processed on this rank (see :class:`cadence.summaries.throughput.LoopWork`).
        The first call with a peak known and no ``Task.flops_per_sample()`` counts the FLOPs.
        Not enabled: nothing known."""
        if not self.enabled:
            return LoopWork(world_size=self.ctx.world_size, shared_by=self.ctx.world_size // self.ctx.dp_size)
        samples = self.samples if self._size_of is not None else None
        tokens = self.tokens if self._tokens_of is not None and self._tokens_known else None
        peak = self.peak_flops()
        flops = self.flops_per_sample(peak) if samples is not None else None
        self._flops_batch = None  # counted, or to be counted with the next loop's
        return LoopWork(samples=samples, tokens=tokens, world_size=self.ctx.world_size, flops_per_sample=flops,
                        peak_flops=peak, shared_by=self.ctx.world_size // self.ctx.dp_size)

    # -- MFU -----------------------------------------------------------------------------------

    def peak_flops(self) -> float | None:
        """This device's peak FLOP/s (resolved once): ``peak_tflops``, else the table's for a CUDA
        device at the run's precision, else ``None``."""
        if not self._peak_resolved:
            self._peak_resolved = True
            if self.peak_tflops is not None:
                self._peak = self.peak_tflops * 1e12
            elif self._cuda:
                name = torch.cuda.get_device_name(self.ctx.device)
                self._peak = peak_flops(name, self.precision, tf32=float32_matmuls_use_tf32())
                if self._peak is None and self.ctx.is_chief:
                    log.info("no MFU: the peak FLOP/s of %r at precision %s is not known; set trainer.peak_tflops",
                             name, self.precision)
        return self._peak

    def flops_per_sample(self, peak: float | None) -> float | None:
        """The training FLOPs of one sample (resolved once): ``Task.flops_per_sample()``, else
        counted (:func:`count_flops_per_sample`) when ``peak`` is known, else ``None``."""
        if self._flops_resolved:
            return self._flops
        given = self.task.flops_per_sample()
        if given is not None:
            self._flops_resolved = True
            if isinstance(given, (int, float)) and not isinstance(given, bool) and math.isfinite(given) and given > 0:
                self._flops = float(given)
            else:
                self._warn("no MFU: %s.flops_per_sample() returned %r; expected a positive number or None",
                           type(self.task).__name__, given)
            return self._flops
        if peak is None:  # nothing to compare with: not counted
            self._flops_resolved = True
            return None
        if self._flops_batch is None:  # no batch seen yet
            return None
        batch, self._flops_batch = self._flops_batch, None
        self._flops_resolved = True
        try:
            self._flops = count_flops_per_sample(self.task, batch)
        except Exception as e:  # noqa: BLE001 -- any failure: go on without MFU, once told why
            self._warn("no MFU: counting the FLOPs of %s's train_step on the meta device failed (%s: %s); "
                       "define Task.flops_per_sample() to give them", type(self.task).__name__, type(e).__name__, e)
        return self._flops

    def _warn(self, message: str, *args: Any) -> None:
        if self.ctx.is_chief:
            log.warning(message, *args)
