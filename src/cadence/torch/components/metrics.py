"""torchmetrics as cadence metric reducers.

A ``torchmetrics.Metric`` accumulates per-process state with ``update(*args)`` and merges the
states of all processes by itself inside ``compute()`` (over the default ``torch.distributed``
process group, or the metric's own ``process_group``). :class:`TorchMetricsReducer` adapts it to
:class:`cadence.metrics.MetricReducer`: its per-slot state is empty, and ``cross_slot_reduce``
calls ``compute()`` — a collective, which :func:`cadence.metrics.reduce_metrics` and the evaluator
call on every rank in the same order. The evaluator wraps a torchmetrics metric returned by
``Task.build_metrics()`` automatically. torchmetrics itself is not a dependency of cadence.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from cadence.metrics import FunctionReducer, MetricReducer

__all__ = ["TorchMetricsReducer", "as_reducer", "is_torchmetrics_metric"]


def is_torchmetrics_metric(obj: Any) -> bool:
    """Duck-typing for a ``torchmetrics.Metric`` / ``MetricCollection``: an ``nn.Module`` with
    callable ``update``, ``compute`` and ``reset``."""
    return isinstance(obj, nn.Module) and all(callable(getattr(obj, n, None)) for n in ("update", "compute", "reset"))


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.numel() == 1 else value.cpu()
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(v) for v in value) if not hasattr(value, "_fields") else value
    return value


class TorchMetricsReducer(MetricReducer):
    """A ``torchmetrics.Metric`` (or ``MetricCollection``) as a :class:`~cadence.metrics.MetricReducer`.

    ``update(value)``: ``metric.update(*value)`` for a tuple (e.g. ``(preds, target)``),
    ``metric.update(**value)`` for a dict, else ``metric.update(value)``. The value is
    ``metric.compute()`` (synchronised across processes by torchmetrics), with 1-element tensors
    as Python numbers and other tensors moved to the CPU.
    """

    def __init__(self, metric: Any) -> None:
        if isinstance(metric, TorchMetricsReducer):
            metric = metric.metric
        self.metric: Any
        if not all(callable(getattr(metric, n, None)) for n in ("update", "compute", "reset")):
            raise TypeError(
                f"TorchMetricsReducer needs a torchmetrics.Metric (update, compute, reset), got {type(metric).__name__}"
            )
        self.metric = metric

    def to(self, device: torch.device | str) -> TorchMetricsReducer:
        """Move the metric's state to ``device`` (where the values fed to it live)."""
        if isinstance(self.metric, nn.Module):
            self.metric.to(device)
        return self

    def reset(self) -> None:
        self.metric.reset()

    def update(self, value: Any) -> None:
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            self.metric.update(*value)
        elif isinstance(value, Mapping):
            self.metric.update(**value)
        else:
            self.metric.update(value)

    def per_slot_reduce(self) -> None:
        return None  # the metric gathers its own state in compute()

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> Any:
        return _to_plain(self.metric.compute())

    def __repr__(self) -> str:
        return f"TorchMetricsReducer({type(self.metric).__name__})"


def as_reducer(obj: Any, *, name: str = "metric") -> MetricReducer:
    """``obj`` as a reducer: a :class:`MetricReducer` as is, a torchmetrics metric wrapped in
    :class:`TorchMetricsReducer`, a plain function in :class:`~cadence.metrics.FunctionReducer`."""
    if isinstance(obj, MetricReducer):
        return obj
    if is_torchmetrics_metric(obj):
        return TorchMetricsReducer(obj)
    if isinstance(obj, type) and issubclass(obj, MetricReducer):
        raise TypeError(f"metric {name!r} is the class {obj.__name__}, not a reducer: write {obj.__name__}()")
    if callable(obj) and not isinstance(obj, (nn.Module, type)):
        return FunctionReducer(obj)
    raise TypeError(
        f"metric {name!r} must be a cadence.metrics.MetricReducer (Mean, Sum, Max, Min, Concat, "
        f"FunctionReducer, ...), a torchmetrics.Metric, or a function of the list of all values; "
        f"got {type(obj).__name__}"
    )
