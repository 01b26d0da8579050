"""The PyTorch implementation of the :class:`cadence.runner.Evaluator` protocol."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from cadence.checkpoint.protocol import CheckpointReader
from cadence.torch.batch import move_to_device
from cadence.torch.context import Context
from cadence.torch.precision import resolve_precision
from cadence.torch.state import MODEL_FILE, RNGSnapshot, load_model_safetensors
from cadence.torch.task import Task


def _overrides(task: Task, name: str) -> bool:
    return getattr(type(task), name) is not getattr(Task, name)


class TorchEvaluator:
    """Runs a :class:`Task`'s validation steps on ``model``.

    ``global_step_fn`` gives the step passed to ``task.reduce_aggregated_logs`` (the trainer's
    step when built by :func:`build_runners`); without it, the step of the last checkpoint
    loaded here (0 before any).
    """

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        *,
        ctx: Context,
        precision: str = "32",
        global_step_fn: Callable[[], int] | None = None,
    ) -> None:
        self.task = task
        self.model = model
        self.ctx = ctx
        self.precision = resolve_precision(precision, ctx.device)
        self._global_step_fn = global_step_fn
        self._loaded_step = 0
        self._eval_data: Iterable[Any] | None = None

    @property
    def global_step(self) -> int:
        return self._global_step_fn() if self._global_step_fn is not None else self._loaded_step

    def _eval_iterator(self) -> Any:
        if self._eval_data is not None:
            it = iter(self._eval_data)
            if it is not self._eval_data:
                return it
        # First call, or the task returned a one-shot iterator: build the inputs afresh.
        self._eval_data = self.task.build_inputs("validation", self.ctx)
        return iter(self._eval_data)

    def evaluate(self, num_steps: int = -1) -> dict[str, float]:
        """Evaluate ``num_steps`` batches (``-1``: all of the validation data); return metrics.

        Scalar outputs of ``validation_step`` (numbers, 1-element tensors) are averaged weighted
        by ``task.batch_size_of(batch)``; a key that is ever non-scalar is not averaged. If
        the task overrides ``aggregate_logs``, every step's outputs go to it and
        ``reduce_aggregated_logs(state, global_step)`` is merged into the result. The model's
        train/eval modes and the global RNG states are restored afterwards, so evaluating
        never changes what training does next.
        """
        if num_steps < -1:
            raise ValueError(f"num_steps must be -1 (all) or >= 0, got {num_steps}")
        task, device, autocast = self.task, self.ctx.device, self.precision.autocast
        aggregate = _overrides(task, "aggregate_logs")
        sums: dict[str, Any] = {}
        weights: dict[str, int] = {}
        non_scalar: set[str] = set()
        agg_state: Any = None
        steps = 0
        modes = [(m, m.training) for m in self.model.modules()]
        rng = RNGSnapshot()
        try:
            self.model.eval()
            with torch.no_grad():
                it = self._eval_iterator() if num_steps != 0 else iter(())
                for batch in it:
                    batch = move_to_device(batch, device)
                    with autocast():
                        out = task.validation_step(self.model, batch)
                    if not isinstance(out, Mapping):
                        raise TypeError(
                            f"{type(task).__name__}.validation_step must return a dict of metrics, "
                            f"got {type(out).__name__}"
                        )
                    bs = task.batch_size_of(batch)
                    for key, v in out.items():
                        if key in non_scalar:
                            continue
                        if isinstance(v, torch.Tensor) and v.numel() == 1:
                            v = v.detach().reshape(()).to(torch.float32) * bs
                        elif isinstance(v, numbers.Real):
                            v = float(v) * bs
                        else:  # once non-scalar, never averaged (a last batch of 1 is not a scalar)
                            non_scalar.add(key)
                            sums.pop(key, None)
                            continue
                        if key in sums:
                            sums[key] = sums[key] + v
                            weights[key] += bs
                        else:
                            sums[key], weights[key] = v, bs
                    if aggregate:
                        agg_state = task.aggregate_logs(agg_state, out)
                    steps += 1
                    if steps == num_steps:
                        break
        finally:
            for m, training in modes:
                m.training = training
            rng.restore()
        result: dict[str, Any] = {}
        tensor_keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
        if tensor_keys:
            stacked = torch.stack([sums[k].to(device) for k in tensor_keys]).tolist()  # one host sync
            result.update({k: s / weights[k] if weights[k] else float("nan") for k, s in zip(tensor_keys, stacked)})
        for k, v in sums.items():
            if not isinstance(v, torch.Tensor):
                result[k] = v / weights[k] if weights[k] else float("nan")
        if aggregate and steps:
            reduced = task.reduce_aggregated_logs(agg_state, self.global_step)
            for k, v in (reduced or {}).items():
                if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, np.generic):
                    v = v.item()
                result[k] = v
        return result

    def load_checkpoint(self, reader: CheckpointReader, state: Mapping[str, Any] | None) -> None:
        """Load ``model.safetensors`` only (an evaluator-only controller); remember the step."""
        source = getattr(reader, "path", "")
        load_model_safetensors(self.model, reader.read(MODEL_FILE), source=f"{source}/{MODEL_FILE}" if source else MODEL_FILE)
        step = state.get("global_step") if isinstance(state, Mapping) else None
        self._loaded_step = int(step if step is not None else reader.step)
