"""The PyTorch implementation of the :class:`cadence.extensions.Evaluator` protocol."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Iterator
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from cadence.checkpoint.protocol import CheckpointReader
from cadence.runtime.coordination import LocalCoordinator
from cadence.errors import ValidationOutputError
from cadence.metrics import MetricReducer, merge_slot_states, slot_states
from cadence.torch.data.batch import move_to_device
from cadence.torch.runtime.context import Context
from cadence.torch.components.ema import ModelEMA, raw_metrics
from cadence.torch.components.metrics import TorchMetricsReducer, as_reducer
from cadence.torch.components.precision import resolve_precision
from cadence.torch.checkpoint_io.kinds import is_sharded_checkpoint
from cadence.torch.parallel.replicas import sync_buffers
from cadence.torch.parallel.sharding import is_sharded, load_full_model, unsharded
from cadence.torch.checkpoint_io.state import MODEL_FILE, load_model_safetensors
from cadence.torch.runtime.rng import RNGSnapshot
from cadence.torch.task.task import Task
from cadence.runtime.watchdog import unwatched


def _overrides(task: Task, name: str) -> bool:
    return getattr(type(task), name) is not getattr(Task, name)


def _host_sums(sums: dict[str, Any]) -> dict[str, float]:
    """The running sums as Python floats (float64), with one host sync for all the tensors."""
    out: dict[str, float] = {}
    tensor_keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    if tensor_keys:
        stacked = torch.stack([sums[k] for k in tensor_keys]).to("cpu", torch.float64).tolist()
        out.update(zip(tensor_keys, stacked))
    for k, v in sums.items():
        if not isinstance(v, torch.Tensor):
            out[k] = float(v)
    return {k: out[k] for k in sums}  # first-seen order


def _fsum(parts: list[float]) -> float:
    try:
        return math.fsum(parts)  # the ranks' partial sums, summed without rounding error
    except (ValueError, OverflowError):  # inf - inf, overflow: as IEEE addition says
        return float(sum(parts))


def _describe(value: Any) -> str:
    """What a step returned, in a few words on one line (a type, and a short value or shape)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    shown = repr(value).replace("\n", " ")
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def _one_shot(data: Any) -> bool:
    """Whether the validation data (or a split of a mapping of them) is an iterator, consumed by one pass."""
    if isinstance(data, Mapping):
        return any(isinstance(v, Iterator) for v in data.values())
    return isinstance(data, Iterator)


def _plain(v: Any) -> Any:
    """1-element tensors and numpy scalars as Python numbers."""
    if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, np.generic):
        return v.item()
    return v


class TorchEvaluator:
    """Runs a :class:`Task`'s validation steps on ``model``.

    ``global_step_fn`` gives the step passed to ``task.reduce_aggregated_logs`` (the trainer's
    step when built by :func:`build_runners`); without it, the step of the last checkpoint
    loaded here (0 before any).

    ``ema``: an EMA of the weights (:class:`~cadence.torch.components.ema.ModelEMA`, the trainer's, or its
    own for an evaluator alone): its weights are the ones evaluated, and loaded with each checkpoint.
    """

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        *,
        ctx: Context,
        precision: str = "32",
        global_step_fn: Callable[[], int] | None = None,
        ema: ModelEMA | None = None,
    ) -> None:
        self.task = task
        self.model = model
        self.ema = ema
        self.ctx = ctx
        self.precision = resolve_precision(precision, ctx.device)
        self._global_step_fn = global_step_fn
        self._loaded_step = 0
        self._eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None

    @property
    def global_step(self) -> int:
        return self._global_step_fn() if self._global_step_fn is not None else self._loaded_step

    def _eval_splits(self) -> list[tuple[str | None, Iterable[Any]]]:
        """The validation inputs as ``(name, iterable)`` pairs: ``[(None, data)]`` for one iterable,
        one pair per split for a mapping ``{name: iterable}``. Built once and reused; built afresh
        when the data (or a split of it) is a one-shot iterator."""
        data = self._eval_data
        if data is None or _one_shot(data):
            with unwatched(self.ctx.heartbeat):  # a slow build (a download) is no hang
                data = self._eval_data = self.task.build_inputs("validation", self.ctx)
        if not isinstance(data, Mapping):
            return [(None, data)]
        bad = [k for k in data if not isinstance(k, str) or not k or "/" in k]
        if bad or not data:
            raise ValidationOutputError(
                f"{type(self.task).__name__}.build_inputs('validation') returned a mapping "
                + (f"with the split name(s) {', '.join(repr(k) for k in bad)}" if bad else "with no split")
                + "; expected {name: iterable} with names that are non-empty strings without '/'"
            )
        return list(data.items())

    def evaluate(self, num_steps: int = -1) -> dict[str, Any]:
        """Evaluate ``num_steps`` batches (``-1``: all of the validation data); return metrics.

        With an EMA (``ema``): the metrics of the EMA's weights (swapped into the model for the
        evaluation, the raw weights back after it), and with ``ema.evaluate_raw`` those of the raw
        weights too, named ``raw/<name>`` (a second evaluation; with named splits
        ``raw/<split>``: ``{"raw/val": {"loss": ...}}``). Without: see :meth:`evaluate_model`.

        On several ranks, rank 0's buffers (BatchNorm's running statistics, and the EMA's averages
        of them), which a checkpoint holds, are first made every rank's (a collective,
        :func:`~cadence.torch.parallel.replicas.sync_buffers`): the model evaluated is the one saved.
        """
        if self.ctx.world_size > 1:
            sync_buffers(self.model, self.ema.buffer_averages() if self.ema is not None else ())
        if self.ema is None:
            return self.evaluate_model(num_steps)
        with self.ema.applied():
            metrics = self.evaluate_model(num_steps)
        if self.ema.evaluate_raw:
            metrics.update(raw_metrics(self.evaluate_model(num_steps)))
        return metrics

    def evaluate_model(self, num_steps: int = -1) -> dict[str, Any]:
        """Evaluate the model's weights as they are on ``num_steps`` batches (``-1``: all of the
        validation data); return metrics.

        Scalar outputs of ``validation_step`` (numbers, 1-element tensors) are averaged weighted
        by ``task.batch_size_of(batch)``; a key that is ever non-scalar is not averaged. Outputs
        named in ``task.build_metrics()`` (fresh reducers for each evaluation) go to their reducer
        instead. If the task overrides ``aggregate_logs``, every step's outputs go to it and
        ``reduce_aggregated_logs(state, global_step)`` is merged into the result.

        Named splits: when ``task.build_inputs("validation", ctx)`` returns a mapping ``{name:
        iterable}``, each split is evaluated in turn as above (``num_steps`` batches of each, its
        own reducers and ``aggregate_logs`` state) and the result is nested, ``{name: {metric:
        value}}``, in the mapping's order.

        In a multi-process evaluation (``ctx.coordinator`` with ``world_size > 1``) each rank
        evaluates its own shard (``num_steps`` batches of it); the weighted sums, the reducers'
        states and the ``aggregate_logs`` states of all ranks (of every split) are gathered in one
        ``all_gather``, so every rank returns the same metrics, those of one process over the union
        of the shards (exact with unpadded shards, e.g. ``ctx.wrap_dataset``). On a device mesh
        with tensor parallelism the shards are the data-parallel ranks' (``ctx.dp_rank``), the ranks
        of a TP group evaluate the same batches, and only the first rank of each TP group is
        merged: every batch counts once. The ``aggregate_logs`` states are merged by
        ``task.merge_aggregated_logs(states)`` (one per data-parallel rank that ran a batch, in rank
        order), which the task must define. An error on one rank is raised on every rank.

        The model's train/eval modes and the global RNG states are restored afterwards, so
        evaluating never changes what training does next.
        """
        if num_steps < -1:
            raise ValueError(f"num_steps must be -1 (all) or >= 0, got {num_steps}")
        task = self.task
        coordinator = self.ctx.coordinator or LocalCoordinator()
        world_size = coordinator.world_size
        aggregate = _overrides(task, "aggregate_logs")
        merge_aggregated = task.merge_aggregated_logs if _overrides(task, "merge_aggregated_logs") else None
        if aggregate and world_size > 1 and merge_aggregated is None:
            raise TypeError(
                f"{type(task).__name__} overrides aggregate_logs, whose state is per process: in an "
                f"evaluation over {world_size} processes each rank aggregates only its own shard. Define "
                f"{type(task).__name__}.merge_aggregated_logs(self, states) -> state, merging the states of "
                f"all ranks (a list in rank order) before reduce_aggregated_logs, or compute these metrics "
                f"with Task.build_metrics() reducers (e.g. cadence.metrics.Concat(fn=...)), which merge "
                f"across processes by themselves"
            )
        local: list[tuple[str | None, dict[str, MetricReducer], Any]] = []  # (split, reducers, aggregate_logs state)
        payload: dict[str, Any] = {}
        failure: BaseException | None = None
        modes = [(m, m.training) for m in self.model.modules()]
        rng = RNGSnapshot()
        # A sharded model (trainer.strategy: fsdp) is gathered for the evaluation (a collective, on
        # every rank before anything that may fail on one): forward then runs no collective, and
        # ranks may evaluate different numbers of batches -- but for a TP model's collectives within
        # a TP group, whose ranks read the same shard (ctx.wrap_dataset) and so the same batches.
        full_params = contextlib.ExitStack()
        full_params.enter_context(unsharded(self.model))
        try:
            self.model.eval()
            parts: list[tuple[str | None, dict[str, Any]]] = []
            with torch.no_grad():
                for name, data in self._eval_splits() if num_steps != 0 else [(None, ())]:
                    reducers = self._build_reducers()  # fresh for each split
                    part, agg_state = self._evaluate_split(data, num_steps, reducers, aggregate,
                                                           ship_aggregated=aggregate and world_size > 1)
                    parts.append((name, part))
                    local.append((name, reducers, agg_state))
            payload = {"splits": parts, "error": None}
        except Exception as e:
            if world_size == 1:
                raise
            failure = e  # still take part in the gather below, so that the other ranks do not hang
            payload = {"error": f"{type(e).__name__}: {e}"}
        finally:
            full_params.close()
            for m, training in modes:
                m.training = training
            rng.restore()

        gathered = coordinator.all_gather(payload) if world_size > 1 else [payload]
        if failure is not None:
            raise failure
        failed = [(rank, p["error"]) for rank, p in enumerate(gathered) if p.get("error")]
        if failed:
            raise RuntimeError(
                "evaluation failed on rank(s) " + ", ".join(f"{rank} ({err})" for rank, err in failed)
            )
        names = [name for name, _, _ in local]
        differ = [rank for rank, p in enumerate(gathered) if [n for n, _ in p["splits"]] != names]
        if differ:
            raise RuntimeError(
                f"the validation splits differ between ranks: {names} here, "
                + ", ".join(f"{[n for n, _ in gathered[r]['splits']]} on rank {r}" for r in differ)
            )
        # On a TP mesh the ranks of a TP group evaluate the same batches: one of them (the first)
        # speaks for the group, so that every batch counts once.
        tp = self.ctx.world_size // self.ctx.dp_size if world_size > 1 else 1
        gathered = gathered[::tp]
        merged = [
            self._merge([p["splits"][i][1] for p in gathered], reducers, agg_state, merge_aggregated)
            for i, (_, reducers, agg_state) in enumerate(local)
        ]
        if names == [None]:  # one iterable: flat metrics
            return merged[0]
        return {str(name): metrics for name, metrics in zip(names, merged)}

    def _evaluate_split(
        self, data: Iterable[Any], num_steps: int, reducers: dict[str, MetricReducer], aggregate: bool,
        *, ship_aggregated: bool,
    ) -> tuple[dict[str, Any], Any]:
        """One split's batches (``num_steps`` of them, ``-1``: all): this rank's payload (weighted
        sums, weights, reducers' states, and the ``aggregate_logs`` state when ``ship_aggregated``)
        and its ``aggregate_logs`` state."""
        task, device, autocast = self.task, self.ctx.device, self.precision.autocast
        # Running sums on the device (no host sync per step), float64 where the device has it.
        acc_dtype = torch.float32 if device.type == "mps" else torch.float64
        sums: dict[str, Any] = {}
        weights: dict[str, int] = {}
        non_scalar: set[str] = set()
        agg_state: Any = None
        steps = 0
        heartbeat = self.ctx.heartbeat  # the watchdog's: one beat per batch
        for batch in data:
            if heartbeat is not None:
                heartbeat.beats += 1
            batch = move_to_device(batch, device)
            with autocast():
                out = task.validation_step(self.model, batch)
            if not isinstance(out, Mapping):
                raise ValidationOutputError(
                    f"{type(task).__name__}.validation_step returned {_describe(out)}; expected a dict "
                    "of metrics, name -> value (a number or a 1-element tensor, averaged over the "
                    "batches), e.g. {'loss': loss, 'accuracy': acc}"
                )
            bs = task.batch_size_of(batch)
            for key, v in out.items():
                if key in reducers:
                    if v is not None:  # None: nothing for this reducer in this batch
                        reducers[key].update(v)
                    continue
                if key in non_scalar:
                    continue
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.detach().reshape(()).to(acc_dtype) * bs
                elif isinstance(v, numbers.Real):
                    v = float(v) * bs
                else:  # once non-scalar, never averaged (a last batch of 1 is not a scalar)
                    non_scalar.add(key)
                    sums.pop(key, None)
                    weights.pop(key, None)
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
        part = {
            "sums": _host_sums(sums),
            "weights": weights,
            "non_scalar": sorted(non_scalar),
            "steps": steps,
            "reducers": slot_states(reducers),
            "aggregated": move_to_device(agg_state, torch.device("cpu")) if ship_aggregated else None,
        }
        return part, agg_state

    def _build_reducers(self) -> dict[str, MetricReducer]:
        built = self.task.build_metrics()
        if built is None:
            return {}
        if not isinstance(built, Mapping):
            raise TypeError(
                f"{type(self.task).__name__}.build_metrics() must return a dict of name -> reducer, "
                f"got {type(built).__name__}"
            )
        reducers: dict[str, MetricReducer] = {}
        for name, obj in built.items():
            r = as_reducer(obj, name=name)
            if isinstance(r, TorchMetricsReducer):
                r.to(self.ctx.device)
            r.reset()  # fresh even if the task hands back the same instances each time
            reducers[name] = r
        return reducers

    def _merge(
        self,
        gathered: list[dict[str, Any]],
        reducers: dict[str, MetricReducer],
        agg_state: Any,
        merge_aggregated: Any,
    ) -> dict[str, Any]:
        """The metrics over all ranks, from every rank's payload (the same on every rank)."""
        non_scalar = {k for p in gathered for k in p["non_scalar"]}
        totals: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        for p in gathered:
            for k, s in p["sums"].items():
                if k in non_scalar:
                    continue
                totals.setdefault(k, []).append(s)
                counts[k] = counts.get(k, 0) + p["weights"][k]
        result: dict[str, Any] = {
            k: _fsum(parts) / counts[k] if counts[k] else float("nan") for k, parts in totals.items()
        }
        total_steps = sum(p["steps"] for p in gathered)
        if reducers and total_steps:
            for k, v in merge_slot_states(reducers, [p["reducers"] for p in gathered]).items():
                result[k] = _plain(v)
        if _overrides(self.task, "aggregate_logs") and total_steps:
            if len(gathered) > 1:
                states = [p["aggregated"] for p in gathered if p["steps"]]
                agg_state = merge_aggregated(states)
            reduced = self.task.reduce_aggregated_logs(agg_state, self.global_step)
            for k, v in (reduced or {}).items():
                result[k] = _plain(v)
        return result

    def load_checkpoint(self, reader: CheckpointReader, state: Mapping[str, Any] | None) -> None:
        """Load the model only (an evaluator-only controller): ``model.safetensors``, or the model
        state of a sharded checkpoint, assembled from every rank's shards (in one process without
        a process group: the sidecar, ``cadence export``), and its EMA with ``ema``; remember the step."""
        source = reader.path
        if is_sharded_checkpoint(reader.names()):
            # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
            from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

            sharded_checkpoint.load_model(source, self.model, storage_options=reader.storage_options)
        else:  # into a sharded model (a sidecar of several ranks), each rank keeps its shards
            load = functools.partial(load_full_model, self.model) if is_sharded(self.model) else None
            load_model_safetensors(self.model, reader.view(MODEL_FILE),
                                   source=f"{source}/{MODEL_FILE}" if source else MODEL_FILE, load=load)
        if self.ema is not None:
            self.ema.load_checkpoint(reader)
        step = state.get("global_step") if isinstance(state, Mapping) else None
        self._loaded_step = int(step if step is not None else reader.step)
