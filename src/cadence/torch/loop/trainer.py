"""The PyTorch implementation of the :class:`cadence.extensions.Trainer` protocol."""

from __future__ import annotations

import copy as copy_module
import functools
import hashlib
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from cadence.checkpoint.background import Pending, Worker
from cadence.checkpoint.protocol import CheckpointReader, CheckpointWriter, ShardTarget
from cadence.extensions import Stateful, StepEnd
from cadence.errors import CheckpointError, ConfigError
from cadence.torch.data.batch import move_to_device
from cadence.torch.components.compile import compile_model
from cadence.torch.runtime.context import Context
from cadence.torch.components.precision import resolve_precision
from cadence.torch.components.ema import EMA_FILE, SHARDED_KEY as EMA_KEY, ModelEMA
from cadence.torch.loop.evaluator import TorchEvaluator
from cadence.torch.checkpoint_io.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    load_model_safetensors,
    SafetensorsPayload,
    clone_tree,
    staged,
    load_torch_state,
    save_torch_state,
    unwrap_model,
)
from cadence.torch.runtime.rng import get_rng_state, seed_everything, set_rng_state
from cadence.torch.checkpoint_io import sharded as sharded_checkpoint
from cadence.torch.checkpoint_io import tensor_tree
from cadence.torch.data import state as data_state
from cadence.torch.parallel import sharding
from cadence.torch.checkpoint_io.shard_writes import ShardWrites, files_of
from cadence.torch.task.step_logs import FOLD, ScalarSum, add_extras, split_output
from cadence.torch.task.task import Task
from cadence.torch.components.throughput import ThroughputMeter
from cadence.summaries.throughput import LoopWork
from cadence.runtime.watchdog import unwatched

if TYPE_CHECKING:
    from cadence.config.components.compile import CompileConfig
    from cadence.config.components.ema import EMAConfig

log = logging.getLogger(__name__)

class TorchTrainer:
    """Runs a :class:`Task`'s training steps; checkpoints everything exact resume needs.

    ``train_data`` defaults to ``task.build_inputs("train", ctx)``, built at the first
    :meth:`train`. Its position is checkpointed through its ``state_dict`` /
    ``load_state_dict`` when it has them; otherwise the number of batches consumed is saved and
    a resume replays (draws and drops) that many batches, which is O(n) and logged.

    ``precision``: ``"32"``, ``"bf16"`` (autocast bfloat16) or ``"fp16"`` (autocast float16 and
    a gradient scaler); raises ``RuntimeError`` at construction if the device cannot run it.
    ``grad_accum_steps``: batches per optimizer step (the loss is divided by it).
    ``grad_clip_norm``: clip the global gradient norm to this value (``None``: no clipping).
    After each optimizer step (after the LR scheduler's) it calls what the controller handed
    :meth:`set_step_end` (:class:`~cadence.extensions.ReportsSteps`: the callbacks'
    ``on_train_step_end``); nothing when none was.
    ``ema``: an EMA of the weights (:class:`~cadence.torch.components.ema.ModelEMA`), started from
    the initial weights, saved into and restored from every checkpoint; it is a callback that
    updates itself after each step: pass it in the controller's callbacks too (the experiment's
    run does). :meth:`train` raises ``RuntimeError`` when it was not.
    ``peak_tflops``: the device's peak TFLOP/s for MFU (``None``: a CUDA device's from
    :mod:`cadence.torch.components.device_peaks`); see :meth:`loop_work`. ``log_throughput=False``: count
    nothing (no samples/s, tokens/s, MFU nor peak memory in the logs).

    ``model`` may be DDP-wrapped or sharded by FSDP2 (:func:`cadence.torch.parallel.sharding.shard_model`,
    ``trainer.strategy: fsdp``): then gradient accumulation skips the reduce-scatter on all but
    the last micro-batch, clipping uses the global norm of the sharded gradients, and checkpoints
    are sharded: every rank writes its shards of the model, optimizer and scheduler state through
    torch.distributed.checkpoint (:meth:`write_shards`; see
    :mod:`cadence.torch.checkpoint_io.sharded`), on any number of ranks loadable.
    """

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None = None,
        *,
        ctx: Context,
        precision: str = "32",
        grad_accum_steps: int = 1,
        grad_clip_norm: float | None = None,
        train_data: Iterable[Any] | None = None,
        ema: ModelEMA | None = None,
        peak_tflops: float | None = None,
        log_throughput: bool = True,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric and cannot be stepped per optimizer step; "
                "step it from an action on evaluation results instead"
            )
        if grad_clip_norm is not None and grad_clip_norm <= 0:
            raise ValueError(f"grad_clip_norm must be None or > 0, got {grad_clip_norm}")
        self.task = task
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.ctx = ctx
        self.precision = resolve_precision(precision, ctx.device)
        self._sharded = sharding.is_sharded(model)
        if self._sharded:
            sharding.check_strategy("fsdp", self.precision.name)
        self.grad_scaler = self.precision.make_grad_scaler()
        self.grad_accum_steps = int(grad_accum_steps)
        self.grad_clip_norm = grad_clip_norm
        self._train_data = train_data
        self.ema = ema
        self._step_end: StepEnd | None = None
        self._iterator: Iterator[Any] | None = None
        self._global_step = 0
        self._batches_consumed = 0  # for replay when the data is not stateful
        self._pending_data_state: dict[str, Any] | None = None
        self._gathered_rng: list[dict[str, Any]] | None = None  # from prepare_checkpoint()
        self._gathered_data: list[dict[str, Any] | None] | None = None  # ditto: every rank's data position
        self._staging: TrainerSnapshot | None = None  # the last asynchronous snapshot (its tensors are reused)
        self._shard_writes = ShardWrites(ctx.rank, ctx.world_size)  # a sharded model's checkpoints
        self._meter = ThroughputMeter(task, ctx, self.precision.name, peak_tflops,  # samples, tokens, FLOPs
                                      enabled=log_throughput)

    # -- protocol ------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints)."""
        return self._global_step

    @property
    def train_data(self) -> Iterable[Any]:
        """The training input (built from the task on first use)."""
        if self._train_data is None:
            with unwatched(self.ctx.heartbeat):  # a slow build (a download) is no hang
                self._train_data = self.task.build_inputs("train", self.ctx)
        return self._train_data

    def initialize(self) -> None:
        """Fresh start (no checkpoint): ``task.initialize(model)`` with the unwrapped model.

        With several ranks, rank 0's parameters and buffers are then broadcast to the others
        (a collective), so that every replica starts from the same weights whatever
        ``initialize`` did, and each rank's RNG is seeded from ``(ctx.seed, rank, 0)``: the
        ranks draw different random numbers (dropout masks, augmentations), reproducibly.
        A sharded model's parameters exist once (each rank holds its shards): only the tensors
        that are not sharded (buffers) are broadcast.
        """
        module = unwrap_model(self.model)
        self.task.initialize(module)
        if self.ctx.world_size > 1:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                from torch.distributed.tensor import DTensor

                with torch.no_grad():
                    for tensor in [*module.parameters(), *module.buffers()]:
                        if not isinstance(tensor, DTensor):
                            torch.distributed.broadcast(tensor.data, src=0)
            seed_everything(_rank_seed(self.ctx.seed, self.ctx.rank, 0))
        if self.ema is not None:
            self.ema.reset()  # from the initial weights (the same on every rank)

    def set_step_end(self, fn: StepEnd | None) -> None:
        """:class:`~cadence.extensions.ReportsSteps`: call ``fn(global_step)`` after each optimizer
        step (after the LR scheduler's step); ``None``: nothing."""
        self._step_end = fn

    def train(self, num_steps: int) -> dict[str, float]:
        """Run up to ``num_steps`` optimizer steps (``grad_accum_steps`` batches each).

        Returns fewer steps only when the train data is exhausted (an incomplete accumulation
        group at the end is dropped, not stepped). Logs: the mean over the loop's steps of
        ``loss`` and of every extra scalar from ``train_step``, and ``learning_rate`` (first
        param group, as in effect after the loop); on CUDA, the loop's peak memory
        (``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``). The host syncs once, at the end.
        Every batch is counted (:meth:`loop_work`).
        """
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if self.ema is not None and not self.ema.attached:
            raise RuntimeError("the trainer's EMA updates itself as a callback: pass trainer.ema in the "
                               "controller's callbacks (Controller(..., callbacks=[trainer.ema]))")
        it = self._iterator if self._iterator is not None else self._start_iterator()
        model, optimizer, scheduler, scaler = self.model, self.optimizer, self.lr_scheduler, self.grad_scaler
        task, device = self.task, self.ctx.device
        autocast = self.precision.autocast if self.precision.dtype is not None else None
        k = self.grad_accum_steps
        clip = self.grad_clip_norm
        params = [p for group in optimizer.param_groups for p in group["params"]] if clip is not None else []
        # DDP / FSDP: skip the gradient all-reduce / reduce-scatter on all but the last micro-batch of a group.
        no_sync: Any = None
        if k > 1 and isinstance(model, nn.parallel.DistributedDataParallel):
            no_sync = model.no_sync
        elif k > 1 and self._sharded:
            no_sync = functools.partial(sharding.no_gradient_sync, model)
        place = device.type != "cpu"  # data loaders yield CPU tensors: nothing to move on CPU
        # The common case (one micro-batch, full precision, no scaler) runs inline: no per-step calls
        # beyond the task's train_step, backward and the optimizer.
        plain = k == 1 and autocast is None and scaler is None and not place
        train_step, forward_backward, step_optimizer = task.train_step, self._forward_backward, optimizer.step
        heartbeat = self.ctx.heartbeat  # the watchdog's: one beat per step
        step_end, start_step = self._step_end, self._global_step
        count = self._meter.start_loop()  # samples and tokens: one Python call per batch (None: off)
        # Detached per-micro-batch losses stay on the device until the end (no per-step sync).
        losses: list[torch.Tensor] = []
        extras_acc: dict[str, ScalarSum] = {}
        steps = consumed = 0
        exhausted = False
        model.train()
        try:
            for _ in range(num_steps):
                optimizer.zero_grad(set_to_none=True)
                if plain:
                    try:
                        batch = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    consumed += 1
                    if count is not None:
                        count(batch)
                    out = train_step(model, batch)
                    loss, extras = split_output(task, out)
                    loss.backward()
                    loss = loss.detach()
                    losses.append(loss.reshape(()) if loss.dim() else loss)
                    if extras is not None:
                        add_extras(extras_acc, extras)
                else:
                    step_start = len(losses)
                    step_extras: list[Mapping[str, Any]] = []
                    for micro in range(k):
                        try:
                            batch = next(it)
                        except StopIteration:
                            exhausted = True
                            break
                        consumed += 1
                        if count is not None:
                            count(batch)
                        if place:
                            batch = move_to_device(batch, device)
                        if no_sync is not None and micro < k - 1:
                            with no_sync():
                                loss, extras = forward_backward(task, model, batch, autocast, scaler, k)
                        else:
                            loss, extras = forward_backward(task, model, batch, autocast, scaler, k)
                        losses.append(loss)
                        if extras is not None:
                            step_extras.append(extras)
                    if exhausted:  # data ran out inside the accumulation group: drop the group
                        del losses[step_start:]
                        optimizer.zero_grad(set_to_none=True)
                        break
                    for extras in step_extras:
                        add_extras(extras_acc, extras)
                if scaler is not None:
                    if clip is not None:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(params, clip)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    if clip is not None:
                        torch.nn.utils.clip_grad_norm_(params, clip)
                    step_optimizer()
                if scheduler is not None:
                    if scaler is not None:
                        with warnings.catch_warnings():  # a step skipped by the scaler is expected
                            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                            scheduler.step()
                    else:
                        scheduler.step()
                steps += 1
                if step_end is not None:
                    step_end(start_step + steps)
                if heartbeat is not None:
                    heartbeat.beats += 1
                if len(losses) >= FOLD:  # bound memory on very long loops: one on-device sum
                    losses[:] = [torch.stack(losses).float().sum()]
        finally:
            self._batches_consumed += consumed
            self._global_step += steps

        logs: dict[str, float] = {}
        if steps:
            keys, means = ["loss"], [torch.stack(losses).float().sum() / (steps * k)]
            for key, acc in extras_acc.items():
                if acc.tensors:
                    keys.append(key)
                    means.append((torch.stack(acc.tensors).to(device).sum() + acc.number) / acc.count)
                else:
                    logs[key] = acc.number / acc.count
            logs.update(zip(keys, torch.stack(means).tolist()))  # the one host sync
        logs["learning_rate"] = float(optimizer.param_groups[0]["lr"])
        logs.update(self._meter.end_loop())
        return logs

    def loop_work(self) -> LoopWork:
        """What the last :meth:`train` call processed on this rank (:class:`cadence.summaries.throughput.CountsWork`,
        called by the controller after the loop, outside its timing): its samples
        (``Task.batch_size_of``), tokens (``Task.tokens_per_batch``), the training FLOPs per sample
        (``Task.flops_per_sample()``, else counted once on the meta device when the peak is known)
        and the device's peak FLOP/s; see :class:`~cadence.torch.components.throughput.ThroughputMeter`."""
        return self._meter.loop_work()

    @staticmethod
    def _forward_backward(
        task: Task, model: nn.Module, batch: Any, autocast: Any, scaler: Any, k: int
    ) -> tuple[torch.Tensor, Mapping[str, Any] | None]:
        if autocast is None:
            out = task.train_step(model, batch)
        else:
            with autocast():
                out = task.train_step(model, batch)
        loss, extras = split_output(task, out)
        backward_loss = loss / k if k > 1 else loss
        if scaler is not None:
            backward_loss = scaler.scale(backward_loss)
        backward_loss.backward()
        loss = loss.detach()
        return (loss.reshape(()) if loss.dim() else loss), extras

    # -- data ----------------------------------------------------------------------------------

    def _start_iterator(self) -> Iterator[Any]:
        data = self.train_data
        pending, self._pending_data_state = self._pending_data_state, None
        skip = 0
        if pending is not None:
            if pending.get("kind") == "stateful":
                if not isinstance(data, Stateful):
                    raise CheckpointError(
                        "the checkpoint's data position was saved through the train data's state_dict, "
                        f"but the train data ({type(data).__name__}) has no load_state_dict"
                    )
                data.load_state_dict(data_state.from_json(pending["state"]))
            else:
                skip = int(pending.get("batches", 0))
        self._iterator = iter(data)
        if skip:
            log.warning(
                "resuming the train data by replaying %d batches (O(n)); give the train data "
                "state_dict/load_state_dict (e.g. cadence.torch.ResumableLoader) to resume in O(1)",
                skip,
            )
            for i in range(skip):
                try:
                    next(self._iterator)
                except StopIteration:
                    log.warning("train data exhausted after replaying %d of %d batches", i, skip)
                    break
        self._batches_consumed = skip
        return self._iterator

    def _data_state(self) -> dict[str, Any] | None:
        if self._iterator is None:
            # Not iterated since construction / the last load: the position is the pending one.
            return self._pending_data_state
        data = self._train_data
        if isinstance(data, Stateful):
            return {"kind": "stateful", "state": data_state.to_json(data.state_dict())}
        return {"kind": "replay", "batches": self._batches_consumed}

    # -- checkpoints ---------------------------------------------------------------------------

    def prepare_checkpoint(self) -> None:
        """Collective, on every rank before the chief's :meth:`save_checkpoint`: gather each
        rank's RNG state and train-data position (through ``ctx.coordinator``) for the chief to
        save."""
        own = (get_rng_state(), self._data_state())
        coord = self.ctx.coordinator
        gathered = coord.all_gather(own) if coord is not None and self.ctx.world_size > 1 else [own]
        self._gathered_rng = [rng for rng, _ in gathered]
        self._gathered_data = [data for _, data in gathered]

    # -- sharded checkpoints (WritesShards) ------------------------------------------------------

    @property
    def writes_shards(self) -> bool:
        """True for a model sharded by FSDP2 over several ranks: every rank writes its shards."""
        return self._sharded

    def write_shards(self, target: ShardTarget) -> None:
        """Collective, on every rank after :meth:`prepare_checkpoint`: write this rank's shards of
        the model, optimizer and scheduler state into ``target.directory`` through
        torch.distributed.checkpoint and gather every rank's files for the chief's
        :meth:`save_checkpoint` (see :class:`~cadence.torch.checkpoint_io.shard_writes.ShardWrites`: with
        ``target.background``, from CPU copies on a background thread)."""
        state = sharded_checkpoint.trainer_state(self.model, self.optimizer, self.lr_scheduler)
        if self.ema is not None:
            state[EMA_KEY] = self.ema.averaged_state()
        self._shard_writes.write(state, target)

    def wait_for_shards(self) -> None:
        """Wait for this rank's background shard write; raise a failure of any rank (every rank
        raises the same :class:`CheckpointError`, once)."""
        self._shard_writes.wait()

    def _rng_states(self) -> list[dict[str, Any]]:
        gathered, self._gathered_rng = self._gathered_rng, None  # used once: never a stale state
        if gathered is not None:
            return gathered
        if self.ctx.world_size > 1:
            log.warning(
                "save_checkpoint without prepare_checkpoint() on all ranks: only rank %d's RNG state is "
                "saved; the other ranks' RNG will be re-seeded on resume", self.ctx.rank,
            )
        return [get_rng_state()]

    def save_checkpoint(self, writer: CheckpointWriter) -> dict[str, Any]:
        """Write ``model.safetensors`` and ``optimizer.safetensors`` (the optimizer, LR scheduler
        and grad-scaler state; ``optimizer.pt`` when that state holds a value the safetensors form
        does not represent, see :mod:`cadence.torch.checkpoint_io.tensor_tree`), and ``ema.safetensors`` with an EMA;
        return ``{"global_step", "rng", "data"}``.

        ``rng`` is a list: the RNG state of every rank, in rank order, as gathered by
        :meth:`prepare_checkpoint` (called on all ranks first; with one process, optional).
        ``data`` is the train data's position: with a :class:`~cadence.torch.ResumableLoader`,
        in global samples, the same on every rank. Called on the chief only. The files are
        streamed into the writer from the tensors' memory (no serialised copy is built).
        """
        return self._capture(copy=False).save_checkpoint(writer)

    def snapshot_checkpoint(self) -> TrainerSnapshot:
        """What :meth:`save_checkpoint` would write, copied now (tensors copied to CPU memory), for
        an asynchronous save to write later while training goes on.

        The copy goes into the previous snapshot's tensors once that one has been written, so
        from the second save on no memory is allocated: a CPU copy of the state stays resident
        between asynchronous saves (as with torch.distributed.checkpoint's async staging)."""
        previous = self._staging if self._staging is not None and self._staging.written else None
        self._staging = self._capture(copy=True, reuse=previous)
        return self._staging

    def _capture(self, *, copy: bool, reuse: TrainerSnapshot | None = None) -> TrainerSnapshot:
        ranks_data, self._gathered_data = self._gathered_data, None  # used once, like the RNG states
        own = ranks_data[self.ctx.rank] if ranks_data is not None else self._data_state()  # not read twice
        state = {"global_step": self._global_step, "rng": self._rng_states(), "data": copy_module.deepcopy(own)}
        if ranks_data is not None and any(d != state["data"] for d in ranks_data):
            state["rank_data"] = ranks_data  # per-rank loader states (a StatefulDataLoader's own shard)
        if self._sharded:
            return TrainerSnapshot(None, {}, state, shards=self._shard_writes.take())
        torch_state = {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }
        model = SafetensorsPayload.from_state_dict(
            unwrap_model(self.model).state_dict(), copy=copy, reuse=reuse.model if reuse is not None else None
        )
        if copy:
            torch_state = clone_tree(torch_state, reuse.torch_state if reuse is not None else None)
        ema = None
        if self.ema is not None:
            ema = self.ema.payload(copy=copy, reuse=reuse.ema if reuse is not None else None)
        snapshot = TrainerSnapshot(model, torch_state, state, ema=ema)
        if copy:  # CUDA tensors were copied to pinned memory without blocking: the writer waits for them
            snapshot.ready = staged({p.device for p in self.model.parameters()} | {self.ctx.device})
        return snapshot

    def load_checkpoint(
        self,
        reader: CheckpointReader,
        state: Mapping[str, Any] | None,
        *,
        restore_data: bool = True,
        restore_rng: bool = True,
    ) -> None:
        """Restore model, optimizer, scheduler, grad scaler, global step, data position, then RNG.

        ``restore_data=False`` / ``restore_rng=False`` keep the current data position / RNG
        (a rollback after a loss spike moves on past the offending batches).

        Every rank loads the same files; rank ``r`` restores ``rng[r]``. A checkpoint saved by
        fewer ranks than now (an elastic resume) has no state for the new ranks: they are seeded
        from ``(ctx.seed, rank, global_step)``, with a warning.

        Raises :class:`~cadence.errors.CheckpointError` (or its subclass
        ``UnsafeCheckpointError``) when a file does not match or would need unsafe unpickling.
        """
        state = dict(state or {})
        source = reader.path
        if sharded_checkpoint.is_sharded_checkpoint(reader.names()):
            # Collective (DCP) when a process group is up: every rank reads the chunks of its shards.
            sharded_checkpoint.load_trainer_state(source, self.model, self.optimizer, self.lr_scheduler,
                                                  storage_options=reader.storage_options)
            if self.grad_scaler is not None:
                log.warning("%s: a sharded checkpoint holds no grad-scaler state: the fp16 loss scale starts afresh",
                            source)
        else:
            self._load_files(reader, source)
        if self.ema is not None:
            self.ema.load_checkpoint(reader)
        self._global_step = int(state.get("global_step", reader.step))
        if restore_data:
            # Data position: applied when iteration (re)starts, so a running iterator is dropped.
            self._iterator = None
            self._batches_consumed = 0
            self._pending_data_state = self._rank_data_state(state, source)
            # Build the data and restart its iteration now, before the RNG is restored: whatever
            # randomness that draws (a random split, a DataLoader's seed) cannot shift the stream.
            self._start_iterator()
        if restore_rng and state.get("rng") is not None:
            self._restore_rng(state["rng"], source)

    def _load_files(self, reader: CheckpointReader, source: str) -> None:
        """Restore the model, optimizer, scheduler and grad scaler from a (not sharded)
        checkpoint's ``model.safetensors`` and ``optimizer.safetensors`` / ``optimizer.pt``."""
        model_source = f"{source}/{MODEL_FILE}" if source else MODEL_FILE
        if self._sharded:  # each rank keeps its shards of the full tensors
            load_model_safetensors(self.model, reader.view(MODEL_FILE), source=model_source,
                                   load=functools.partial(sharding.load_full_model, self.model))
        else:
            load_model_safetensors(self.model, reader.view(MODEL_FILE), source=model_source)
        opt_name = OPTIMIZER_TENSORS_FILE if OPTIMIZER_TENSORS_FILE in reader.names() else OPTIMIZER_FILE
        opt_source = f"{source}/{opt_name}" if source else opt_name
        if opt_name == OPTIMIZER_TENSORS_FILE:
            opt_state = tensor_tree.load_tree(reader.view(opt_name), source=opt_source, map_location=self.ctx.device)
        else:
            opt_state = load_torch_state(reader.read(opt_name), name=opt_name, source=source,
                                         map_location=self.ctx.device)
        if not isinstance(opt_state, Mapping) or "optimizer" not in opt_state:
            raise CheckpointError(f"{opt_source}: expected a dict with 'optimizer'")
        try:
            if self._sharded:
                sharding.load_full_optimizer(self.model, self.optimizer, opt_state["optimizer"])
            else:
                self.optimizer.load_state_dict(opt_state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"{opt_source}: optimizer state does not match: {e}") from e
        sched_state = opt_state.get("lr_scheduler")
        if self.lr_scheduler is not None and sched_state is not None:
            self.lr_scheduler.load_state_dict(sched_state)
        elif (self.lr_scheduler is None) != (sched_state is None):
            log.warning("%s: LR scheduler present in %s but not in %s: not restored", source,
                        "the checkpoint" if sched_state is not None else "the trainer",
                        "the trainer" if sched_state is not None else "the checkpoint")
        scaler_state = opt_state.get("grad_scaler")
        if self.grad_scaler is not None and scaler_state:
            self.grad_scaler.load_state_dict(scaler_state)
        elif self.grad_scaler is not None:
            log.warning("%s: no grad-scaler state in the checkpoint: the fp16 loss scale starts afresh", source)

    def _rank_data_state(self, state: Mapping[str, Any], source: str) -> Any:
        """This rank's data position: its own when the ranks' differ (``rank_data``: a loader
        whose state is per rank, such as torchdata's ``StatefulDataLoader``), else ``data``."""
        ranks = state.get("rank_data")
        if not isinstance(ranks, list) or not ranks:
            return state.get("data")
        rank, world_size = self.ctx.rank, self.ctx.world_size
        if len(ranks) != world_size and rank == 0:
            log.warning(
                "%s: the train data's position is per rank (its loader's own state, e.g. a StatefulDataLoader) and was "
                "saved by %d rank(s), resumed on %d: each rank continues from the saved state of the rank with its "
                "number (or rank 0's), so samples may be repeated or skipped; a cadence.torch.ResumableLoader keeps "
                "its position in global samples across world sizes", source or "checkpoint", len(ranks), world_size,
            )
        return ranks[rank] if rank < len(ranks) else state.get("data")

    def _restore_rng(self, saved: Any, source: str) -> None:
        states = [saved] if isinstance(saved, Mapping) else list(saved)  # a dict: before per-rank states
        rank, world_size = self.ctx.rank, self.ctx.world_size
        if rank < len(states):
            set_rng_state(states[rank])
        else:
            seed = _rank_seed(self.ctx.seed, rank, self._global_step)
            log.warning(
                "%s: the checkpoint holds the RNG states of %d rank(s), none for rank %d of %d (an elastic "
                "resume): its RNG is seeded from (seed=%d, rank=%d, global_step=%d) instead",
                source or "checkpoint", len(states), rank, world_size, self.ctx.seed, rank, self._global_step,
            )
            seed_everything(seed)
        if rank == 0 and len(states) != world_size:
            log.warning(
                "%s: saved by %d rank(s), resumed on %d: the state is resharded and the data position kept (in "
                "global samples with a resumable loader), but the run is not promised to be bit-identical to one "
                "that kept %d rank(s)", source or "checkpoint", len(states), world_size, len(states),
            )
        if rank == 0 and len(states) > world_size:
            unused = f"rank {world_size}" if len(states) == world_size + 1 else f"ranks {world_size}-{len(states) - 1}"
            log.warning(
                "%s: the checkpoint holds the RNG states of %d ranks, this job has %d: that of %s is not used "
                "(an elastic resume)", source or "checkpoint", len(states), world_size, unused,
            )


class TrainerSnapshot:
    """A :class:`TorchTrainer`'s checkpoint content captured at one moment: the model's tensors,
    the optimizer / scheduler / grad-scaler state and the JSON state. ``save_checkpoint(writer)``
    writes it (see :meth:`TorchTrainer.save_checkpoint`)."""

    def __init__(self, model: SafetensorsPayload | None, torch_state: dict[str, Any], state: dict[str, Any],
                 *, shards: Pending | None = None, ema: SafetensorsPayload | None = None) -> None:
        self.model = model
        self.ema = ema  # ema.safetensors (an EMA of the weights), or None
        self.torch_state = torch_state
        self.state = state
        self.shards = shards  # a sharded checkpoint: the ranks' write of their files
        self.written = False  # True once save_checkpoint is done with the tensors (then reusable)
        self.ready: Any = None  # set for CUDA state: the device-to-host copies are done once it synchronizes

    def save_checkpoint(self, writer: CheckpointWriter) -> dict[str, Any]:
        """Write the model's file (then the EMA's) here and the optimizer's on a helper thread, at once
        (writes, checksums and fsyncs release the GIL); return the JSON state. A sharded checkpoint: wait
        for the ranks' write and add every rank's files."""
        if self.shards is not None:
            for rank, files in enumerate(files_of(self.shards, 0)):
                writer.add_files(files, rank=rank)
            self.written = True
            return self.state
        assert self.model is not None
        try:
            if self.ready is not None:
                self.ready.synchronize()
            optimizer = _FILE_WRITER.submit(self._write_optimizer, writer)
            try:
                with writer.open(MODEL_FILE) as f:
                    self.model.write(f)
                if self.ema is not None:
                    with writer.open(EMA_FILE) as f:
                        self.ema.write(f)
            except BaseException:
                optimizer.wait()  # done with the tensors; the model's error wins
                raise
            optimizer.result()
        finally:
            self.written = True
        return self.state

    def _write_optimizer(self, writer: CheckpointWriter) -> None:
        try:
            optimizer = tensor_tree.payload(self.torch_state)
        except tensor_tree.NotFlat as e:
            log.debug("optimizer state saved with torch.save: %s", e)
            with writer.open(OPTIMIZER_FILE) as f:
                save_torch_state(f, self.torch_state, OPTIMIZER_FILE)
            return
        with writer.open(OPTIMIZER_TENSORS_FILE) as f:
            optimizer.write(f)


_FILE_WRITER = Worker("cadence-write")  # writes a checkpoint's second file beside the first


def _rank_seed(seed: int, rank: int, global_step: int) -> int:
    """A seed for a rank that has no saved RNG state: the same for the same (seed, rank, step)."""
    digest = hashlib.sha256(f"cadence-rng:{seed}:{rank}:{global_step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def build_runners(
    task: Task,
    ctx: Context,
    *,
    precision: str = "32",
    grad_accum_steps: int = 1,
    grad_clip_norm: float | None = None,
    train: bool = True,
    evaluate: bool = True,
    strategy: str = "ddp",
    lr_schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    ema: EMAConfig | None = None,
    peak_tflops: float | None = None,
    log_throughput: bool = True,
    compile_config: CompileConfig | None = None,
) -> tuple[TorchTrainer | None, TorchEvaluator | None]:
    """``(trainer, evaluator)`` sharing one model built by ``task.build_model()`` on ``ctx.device``.

    The optimizer and LR scheduler are built only when ``train``; the evaluator reports the
    trainer's global step. A role not asked for is ``None``. The trainer trains
    ``ctx.wrap_model(model)`` (DistributedDataParallel when ``ctx.world_size > 1``: a
    collective, every rank builds its runners at the same point); the evaluator runs the
    unwrapped model (the same parameters).

    ``strategy="fsdp"``: when training on several ranks, the model is sharded with FSDP2 instead
    (:func:`cadence.torch.parallel.sharding.shard_model`, the units ``task.fsdp_units(model)`` names; a
    collective), before the optimizer is built over its sharded parameters; the evaluator runs
    the same sharded module. ``ValueError`` for an unknown strategy or ``precision="fp16"`` with
    ``"fsdp"``.

    ``lr_schedule``: builds the LR scheduler from the optimizer (the config's
    ``trainer.lr_schedule``) when the task's ``build_lr_scheduler`` returns ``None``; a
    :class:`~cadence.errors.ConfigError` when it returns a scheduler too.

    ``ema``: keep an EMA of the weights (the config's ``trainer.ema``), one
    :class:`~cadence.torch.components.ema.ModelEMA` over the (sharded) model shared by the trainer (which
    updates and checkpoints it) and the evaluator (which evaluates it; alone, it loads it).

    ``peak_tflops``: the device's peak TFLOP/s for the trainer's MFU (the config's
    ``trainer.peak_tflops``; ``None``: a CUDA device's from the table, none on CPU).
    ``log_throughput``: the trainer counts samples, tokens and FLOPs (``trainer.log_throughput``).

    ``compile_config``: ``torch.compile`` the model's forward in place (the config's
    ``trainer.compile``; :func:`cadence.torch.components.compile.compile_model`), before the DDP wrap, or, for
    ``strategy="fsdp"`` on several ranks, each FSDP unit before it is sharded; the evaluator runs
    the compiled model too. State-dict keys are the eager model's. ``None``: eager.
    """
    if not (train or evaluate):
        raise ValueError("build_runners: nothing to build (train=False and evaluate=False)")
    sharding.check_strategy(strategy, resolve_precision(precision, ctx.device).name)
    model = task.build_model().to(ctx.device)
    if compile_config is not None:
        compile_model(task, model, compile_config, per_unit=train and strategy == "fsdp" and ctx.world_size > 1)
    trainer = None
    if train:
        # DDP's parameters are the module's own tensors: the optimizer built on the module updates
        # the wrapped model (and the task's build_optimizer may reach into the module's attributes).
        # fully_shard replaces them by DTensor shards in place: the optimizer is built after it.
        if strategy == "fsdp":
            wrapped = sharding.shard_model(model, task.fsdp_units(model), ctx, resolve_precision(precision, ctx.device).name,
                                           declared_by=f"{type(task).__name__}.fsdp_units")
        else:
            wrapped = ctx.wrap_model(model)
        optimizer = task.build_optimizer(model)
        scheduler = task.build_lr_scheduler(optimizer)
        if lr_schedule is not None:
            if scheduler is not None:
                raise ConfigError(
                    f"trainer.lr_schedule is set, and {type(task).__name__}.build_lr_scheduler() returns a "
                    f"{type(scheduler).__name__} too: remove one of them"
                )
            scheduler = lr_schedule(optimizer)
        trainer = TorchTrainer(
            task,
            wrapped,
            optimizer,
            scheduler,
            ctx=ctx,
            precision=precision,
            grad_accum_steps=grad_accum_steps,
            grad_clip_norm=grad_clip_norm,
            ema=ModelEMA(wrapped, ema) if ema is not None else None,
            peak_tflops=peak_tflops,
            log_throughput=log_throughput,
        )
    evaluator = None
    if evaluate:
        step_fn = (lambda: trainer.global_step) if trainer is not None else None
        if trainer is not None:
            evaluated = trainer.ema
        else:
            evaluated = ModelEMA(model, ema) if ema is not None else None
        evaluator = TorchEvaluator(task, model, ctx=ctx, precision=precision, global_step_fn=step_fn, ema=evaluated)
    return trainer, evaluator
