"""The PyTorch implementation of the :class:`cadence.extensions.Trainer` protocol."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from cadence.checkpoint.protocol import CheckpointReader, CheckpointWriter, ShardTarget
from cadence.errors import ConfigError
from cadence.extensions import StepEnd
from cadence.summaries.throughput import LoopWork
from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.components.ema import ModelEMA
from cadence.torch.components.precision import resolve_precision
from cadence.torch.components.throughput import ThroughputMeter
from cadence.torch.loop.forward_backward import accumulate_step
from cadence.torch.loop.train_data import TrainData
from cadence.torch.loop.trainer_checkpoint import TrainerCheckpoint
from cadence.torch.loop.trainer_snapshot import TrainerSnapshot
from cadence.torch.parallel import sharding
from cadence.torch.parallel.dp_mean import mean_over_dp_ranks
from cadence.torch.parallel.grad_norm import clip_grad_norm_
from cadence.torch.parallel.mesh import MeshDegrees
from cadence.torch.runtime.context import Context
from cadence.torch.runtime.distributed import broadcast_unsharded
from cadence.torch.runtime.rng import rank_seed, seed_everything
from cadence.torch.task.step_logs import FOLD, ScalarSum, add_extras, split_output
from cadence.torch.task.lr_schedule import LRSchedule, TrainingPlan
from cadence.torch.task.task import Task

log = logging.getLogger(__name__)


class TorchTrainer:
    """Runs a :class:`Task`'s training steps; checkpoints everything exact resume needs.

    ``train_data`` defaults to ``task.build_inputs("train", ctx)``, built at the first
    :meth:`train`. Its position is checkpointed through its ``state_dict`` /
    ``load_state_dict`` when it has them; otherwise the number of batches consumed is saved and
    a resume skips them (a plain ``DataLoader``: none of their samples loaded) or replays (draws
    and drops) them, which is O(n) and logged
    (:class:`~cadence.torch.loop.train_data.TrainData`). What a checkpoint holds is written and read
    by :class:`~cadence.torch.loop.trainer_checkpoint.TrainerCheckpoint`.

    ``precision``: ``"32"``, ``"bf16"`` (autocast bfloat16) or ``"fp16"`` (autocast float16 and
    a gradient scaler); raises ``RuntimeError`` at construction if the device cannot run it.
    ``grad_accum_steps``: batches per optimizer step (the loss is divided by it).
    ``grad_clip_norm``: clip the global gradient norm (over every mesh dimension:
    :func:`~cadence.torch.parallel.grad_norm.clip_grad_norm_`) to this value (``None``: no clipping).
    ``lr_scheduler``: a scheduler, stepped after every optimizer step, or an
    :class:`~cadence.torch.task.lr_schedule.LRSchedule` saying when: every ``frequency``-th step, or
    (``interval="epoch"``) when every ``frequency``-th epoch of the train data ends, as the next
    epoch's first batch is drawn (so a checkpoint at an epoch's last step resumes to the same step).
    After each optimizer step (after the LR scheduler's) it calls what the controller handed
    :meth:`set_step_end` (:class:`~cadence.extensions.ReportsSteps`: the callbacks'
    ``on_train_step_end``); nothing when none was.
    ``ema``: an EMA of the weights (:class:`~cadence.torch.components.ema.ModelEMA`), started from
    the initial weights, saved into and restored from every checkpoint; it is a callback that
    updates itself after each step: pass it in the controller's callbacks too (the experiment's
    run does). :meth:`train` raises ``RuntimeError`` when it was not.
    ``peak_tflops``: the device's peak TFLOP/s for MFU (``None``: a CUDA device's from
    :mod:`cadence.torch.components.device_peaks`); see :meth:`loop_work`. ``log_throughput=False``: count
    nothing (no samples/s, tokens/s, MFU nor peak memory in the logs). ``pipelined_snapshots``:
    an asynchronous save's copy runs beside the next step (see :meth:`snapshot_checkpoint`).
    ``initial_weights``: loads a fresh start's weights into the unwrapped model before
    ``Task.initialize`` (``task.init_from_pretrained``; see :meth:`initialize`). ``mesh``: ``trainer.parallel``'s
    degrees, saved in each checkpoint (a resume on another mesh says so). :attr:`replicas`, when set: fault-tolerant
    replica groups (:class:`~cadence.torch.fault_tolerance.ReplicaSync`: each step's quorum, healing, average, vote).

    A re-iterable ``train_data`` (a ``DataLoader``) that runs out mid-loop starts its next epoch
    (``set_epoch`` on it or its sampler first); ``max_epochs`` (``None``: no bound) ends the data
    after that many epochs, and then :attr:`training_ended` is true
    (:class:`~cadence.extensions.EndsTraining`). A one-shot iterator that runs out ends it too.
    ``ends_with_data``: nothing else ends training (``train_steps=None``): a re-iterable input
    without ``max_epochs`` is then a :class:`~cadence.errors.ConfigError` when it starts.

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
        lr_scheduler: Any | LRSchedule | None = None,
        *,
        ctx: Context,
        precision: str = "32",
        grad_accum_steps: int = 1,
        grad_clip_norm: float | None = None,
        train_data: Iterable[Any] | None = None,
        ema: ModelEMA | None = None,
        peak_tflops: float | None = None,
        log_throughput: bool = True,
        max_epochs: int | None = None,
        ends_with_data: bool = False,
        pipelined_snapshots: bool = True,
        initial_weights: Callable[[nn.Module], None] | None = None,
        mesh: MeshDegrees | None = None,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        schedule = lr_scheduler if isinstance(lr_scheduler, LRSchedule) else LRSchedule(lr_scheduler)
        if isinstance(schedule.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric and cannot be stepped per optimizer step; "
                "step it from an action on evaluation results instead"
            )
        if grad_clip_norm is not None and grad_clip_norm <= 0:
            raise ValueError(f"grad_clip_norm must be None or > 0, got {grad_clip_norm}")
        self.task = task
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler: Any = schedule.scheduler
        self.lr_interval, self.lr_frequency = schedule.interval, schedule.frequency
        self.ctx = ctx
        self.precision = resolve_precision(precision, ctx.device)
        self._sharded = sharding.is_sharded(model)
        if self._sharded:
            sharding.check_strategy("fsdp", self.precision.name)
        self.grad_scaler = self.precision.make_grad_scaler()
        self.grad_accum_steps = int(grad_accum_steps)
        self.grad_clip_norm = grad_clip_norm
        self._data = TrainData(task, ctx, train_data, max_epochs=max_epochs,  # the input, its epoch and position
                               ends_with_data=ends_with_data)
        self.ema = ema
        self.pipelined_snapshots = pipelined_snapshots
        self.initial_weights = initial_weights
        self._step_end: StepEnd | None = None
        self._global_step = self._loop_start = 0
        self._checkpoint = TrainerCheckpoint(self, sharded=self._sharded, mesh=mesh)  # what checkpoints hold
        if ema is not None:
            ema.fence = self._checkpoint.fence  # its swap waits for a pipelined snapshot's copy
        self._meter = ThroughputMeter(task, ctx, self.precision.name, peak_tflops,  # samples, tokens, FLOPs
                                      enabled=log_throughput)
        self.replicas: Any = None  # fault-tolerant replica groups: a ReplicaSync (cadence.torch.fault_tolerance)

    # -- protocol ------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints)."""
        return self._global_step

    @property
    def loop_start_step(self) -> int:
        """:class:`~cadence.extensions.JoinsPeers`: where the last :meth:`train` counted from (healed: a peer's)."""
        return self._loop_start

    @property
    def training_ended(self) -> bool:
        """:class:`~cadence.extensions.EndsTraining`: the train data ended after ``max_epochs`` epochs."""
        return self._data.ended

    @property
    def planned_steps(self) -> int | None:
        """:class:`~cadence.extensions.PlansSteps`: the global step at which ``max_epochs`` epochs
        end (:attr:`TrainingPlan.total_steps`), for a train input with a length; ``None`` otherwise."""
        if self._data.max_epochs is None or not self._data.has_epochs:
            return None
        return self.plan().total_steps

    def plan(self, train_steps: int | None = None) -> TrainingPlan:
        """The length of training: the train input's (built now) batches per epoch, ``max_epochs``,
        ``grad_accum_steps`` and ``train_steps``."""
        return TrainingPlan(self._data.batches_per_epoch, self.grad_accum_steps, self._data.max_epochs, train_steps)

    @property
    def train_data(self) -> Iterable[Any]:
        """The training input (built from the task on first use)."""
        return self._data.data

    def wait_for_snapshot(self) -> None:
        """Wait for a pipelined snapshot's copy still in flight (:meth:`snapshot_checkpoint`): before
        anything replaces the state it copies (a load, a fresh start, a peer's state)."""
        self._checkpoint.fence.wait()

    @property
    def input_position(self) -> TrainData:
        """The training input's iteration and position (``state()``, ``restore()``)."""
        return self._data

    def initialize(self) -> None:
        """Fresh start (no checkpoint): ``initial_weights(model)`` when given, then
        ``task.initialize(model)``, with the unwrapped model.

        With several ranks, rank 0's parameters and buffers are then broadcast to the others
        (a collective), so that every replica starts from the same weights whatever
        ``initialize`` did, and each rank's RNG is seeded from ``(ctx.seed, ctx.dp_rank, 0)``: the
        data-parallel ranks draw different random numbers (dropout masks, augmentations),
        reproducibly, and the ranks of a tensor-parallel group the same ones.
        A sharded model's parameters exist once (each rank holds its shards): only the tensors
        that are not sharded (buffers) are broadcast.
        """
        self.wait_for_snapshot()
        module = unwrap_model(self.model)
        if self.initial_weights is not None:
            self.initial_weights(module)
        self.task.initialize(module)
        if self.ctx.world_size > 1:
            broadcast_unsharded(module)
        if self.ctx.world_size > 1 or self.ctx.replica_groups > 1:  # every data shard its own draws
            seed_everything(rank_seed(self.ctx.seed, self.ctx.data_shard()[0], 0))
        if self.ema is not None:
            self.ema.reset()  # from the initial weights (the same on every rank)

    def close_data(self) -> None:
        """End the train data's running iteration (its loader's worker processes exit now)."""
        self._data.close()

    def set_step_end(self, fn: StepEnd | None) -> None:
        """:class:`~cadence.extensions.ReportsSteps`: call ``fn(global_step)`` after each optimizer
        step (after the LR scheduler's step); ``None``: nothing."""
        self._step_end = fn

    def train(self, num_steps: int) -> dict[str, float]:
        """Run up to ``num_steps`` optimizer steps (``grad_accum_steps`` batches each).

        Returns fewer steps only when the train data has ended (see the class doc; an incomplete
        accumulation group at the end is dropped, not stepped). Logs: the mean over the loop's steps
        of ``loss`` (and over the data-parallel ranks: one all-reduce per loop, every rank the same
        value) and of every extra scalar from ``train_step`` (this rank's), ``epoch`` (the epoch of the
        loop's last batch, from 0; once the data was iterated again, or with ``max_epochs``), and
        ``learning_rate`` (first param group: the rate the loop's last step trained at; with no
        step, the next one's); on CUDA, the loop's peak memory (``memory/peak_allocated_gib``,
        ``memory/peak_reserved_gib``). The host syncs once, at the end. Every batch is counted
        (:meth:`loop_work`).
        """
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if self.ema is not None and not self.ema.attached:
            raise RuntimeError("the trainer's EMA updates itself as a callback: pass trainer.ema in the "
                               "controller's callbacks (Controller(..., callbacks=[trainer.ema]))")
        it = self._data.iterator()
        model, optimizer, scheduler, scaler = self.model, self.optimizer, self.lr_scheduler, self.grad_scaler
        if scheduler is not None and self.lr_interval == "epoch" and not self._data.has_epochs:
            raise ConfigError(f"the LR scheduler is stepped per epoch, but the train data ({type(self.train_data).__name__}) "
                              "never ends an epoch (a one-shot iterator, or a ResumableLoader with epochs=None): return a "
                              "finite, re-iterable input or step it per step")
        per_step = scheduler if self.lr_interval == "step" else None  # stepped here; per epoch: at an epoch's start
        lr_every = self.lr_frequency
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
        train_step, step_optimizer = task.train_step, optimizer.step
        heartbeat = self.ctx.heartbeat  # the watchdog's: one beat per step
        # A pipelined snapshot's copy runs beside this loop's first forward and backward passes (it
        # starts now), and is waited for before the first optimizer step (cadence.torch.checkpoint_io.pipelined).
        fence = self._checkpoint.fence if self._checkpoint.fence.resume() else None
        step_end, start_step, sync = self._step_end, self._global_step, self.replicas
        count = self._meter.start_loop()  # samples and tokens: one Python call per batch (None: off)
        count = sync.positions.counting(count) if sync is not None else count  # and the groups' sample counts
        # Detached per-micro-batch losses stay on the device until the end (no per-step sync).
        losses: list[torch.Tensor] = []
        extras_acc: dict[str, ScalarSum] = {}
        steps = consumed = 0
        exhausted = False
        lr_group, trained_lr = optimizer.param_groups[0], None  # the rate of the last step, read before the scheduler's
        model.train()
        try:
            while steps < num_steps:
                optimizer.zero_grad(set_to_none=True)
                if sync is not None and (healed := sync.start_step(start_step + steps, consumed)) is not None:
                    num_steps = steps + max(1, start_step + num_steps - healed)  # to the step asked for, or one
                    self._global_step = start_step = healed - steps  # a live peer's state: go on from its step
                    if self._data.iterator() is not it:  # its own data position taken from the peer's table
                        it, consumed = self._data.iterator(), 0
                if plain:
                    try:
                        batch = next(it)
                    except StopIteration:  # the epoch's end: the next one's first batch, if any
                        started, consumed = self._data.next_epoch(consumed), 0
                        if started is None:
                            exhausted = True
                            break
                        it, batch = started
                        self._epoch_started()
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
                    it, consumed, exhausted = accumulate_step(task, model, it, consumed, self._data, k, count,
                                                              device if place else None, no_sync, autocast, scaler,
                                                              losses, extras_acc, self._epoch_started)
                    if exhausted:
                        optimizer.zero_grad(set_to_none=True)
                        break
                if fence is not None:
                    fence.wait()
                    fence = None
                if sync is not None and not sync.commit(steps + 1 >= num_steps, consumed):  # a group was lost: again
                    del losses[-k:]
                    continue
                if scaler is not None:
                    if clip is not None:
                        scaler.unscale_(optimizer)
                        clip_grad_norm_(params, clip)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    if clip is not None:
                        clip_grad_norm_(params, clip)
                    step_optimizer()
                if scheduler is not None:
                    trained_lr = lr_group["lr"]
                if per_step is not None and (lr_every == 1 or (start_step + steps + 1) % lr_every == 0):
                    if scaler is not None:
                        with warnings.catch_warnings():  # a step skipped by the scaler is expected
                            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                            per_step.step()
                    else:
                        per_step.step()
                steps += 1
                if step_end is not None:
                    step_end(start_step + steps)
                if heartbeat is not None:
                    heartbeat.beats += 1
                if len(losses) >= FOLD:  # bound memory on very long loops: one on-device sum
                    losses[:] = [torch.stack(losses).float().sum()]
        finally:
            self._data.batches_consumed += consumed
            self._global_step += steps
            self._loop_start = start_step

        logs: dict[str, float] = {}
        if steps:
            # The mean over the data-parallel ranks: one all-reduce per loop (not rank 0's own loss).
            keys, means = ["loss"], [mean_over_dp_ranks(torch.stack(losses).float().sum() / (steps * k), self.ctx)]
            for key, acc in extras_acc.items():
                if acc.tensors:
                    keys.append(key)
                    means.append((torch.stack(acc.tensors).to(device).sum() + acc.number) / acc.count)
                else:
                    logs[key] = acc.number / acc.count
            logs.update(zip(keys, torch.stack(means).tolist()))  # the one host sync
        logs["learning_rate"] = float(trained_lr if trained_lr is not None else lr_group["lr"])
        if self._data.reiterable and (self._data.epoch or self._data.max_epochs is not None):
            logs["epoch"] = float(self._data.epoch)
        logs.update(self._meter.end_loop())
        logs.update(sync.loop_logs() if sync is not None else {})  # replicas, replica_retries
        return logs

    def _epoch_started(self) -> None:
        """A new epoch of the train data started (its first batch drawn): step an epoch-stepped LR
        scheduler when the epochs ended so far are a multiple of its frequency."""
        if self.lr_scheduler is not None and self.lr_interval == "epoch" and self._data.epoch % self.lr_frequency == 0:
            self.lr_scheduler.step()

    def loop_work(self) -> LoopWork:
        """What the last :meth:`train` call processed on this rank (:class:`cadence.summaries.throughput.CountsWork`,
        called by the controller after the loop, outside its timing): its samples
        (``Task.batch_size_of``), tokens (``Task.tokens_per_batch``), the training FLOPs per sample
        (``Task.flops_per_sample()``, else counted once on the meta device when the peak is known)
        and the device's peak FLOP/s; see :class:`~cadence.torch.components.throughput.ThroughputMeter`."""
        return self._meter.loop_work()

    # -- checkpoints (see :mod:`cadence.torch.loop.trainer_checkpoint`) -----------------------------

    def prepare_checkpoint(self) -> None:
        """Collective, on every rank before the chief's :meth:`save_checkpoint`: make rank 0's
        buffers (BatchNorm's running statistics; the EMA's averages of them) every rank's, so that
        what is saved is what every rank holds and evaluates, then gather each rank's RNG state and
        train-data position (through ``ctx.coordinator``) for the chief to save."""
        self._checkpoint.prepare(self._data.state())

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
        self._checkpoint.write_shards(target, pipelined=self.pipelined_snapshots)

    def wait_for_shards(self) -> None:
        """Wait for this rank's background shard write; raise a failure of any rank (every rank
        raises the same :class:`CheckpointError`, once)."""
        self._checkpoint.wait_for_shards()

    def save_checkpoint(self, writer: CheckpointWriter) -> dict[str, Any]:
        """Write ``model.safetensors`` and ``optimizer.safetensors`` (the optimizer, LR scheduler
        and grad-scaler state; ``optimizer.pt`` when that state holds a value the safetensors form
        does not represent, see :mod:`cadence.torch.checkpoint_io.tensor_tree`), and ``ema.safetensors`` with an EMA;
        return ``{"global_step", "rng", "data"}``.

        ``rng`` is a list: the RNG state of every rank, in rank order, as gathered by
        :meth:`prepare_checkpoint` (called on all ranks first; with one process, optional); on a
        mesh with ``tp > 1``, ``rng_tp`` is its TP degree (the ranks of a TP group hold equal states).
        ``data`` is the train data's position: with a :class:`~cadence.torch.ResumableLoader`,
        in global samples, the same on every rank. Called on the chief only. The files are
        streamed into the writer from the tensors' memory (no serialised copy is built).
        """
        return self._checkpoint.capture(self._global_step, self._data.state, copy=False).save_checkpoint(writer)

    def snapshot_checkpoint(self) -> TrainerSnapshot:
        """What :meth:`save_checkpoint` would write, copied to CPU memory, for an asynchronous save
        to write later while training goes on.

        Pipelined (``pipelined_snapshots``, the default): only what the next forward pass changes
        is copied before this returns (the RNG states, the data position, the buffers, the LR
        scheduler's and grad scaler's state); the parameters, the optimizer state and the EMA are
        copied on a background thread (CUDA: a side stream) beside the next step's forward and
        backward passes, and :meth:`train` waits for what is left of that copy before its first
        optimizer step (a load and the EMA's swap wait too). The checkpoint is the one a
        synchronous save at this step would write, bit for bit. A ``train_step`` that changes
        parameters or optimizer state in place (not through the optimizer) needs
        ``pipelined_snapshots=False``: then everything is copied before this returns.

        The copy goes into the previous snapshot's tensors once that one has been written, so
        from the second save on no memory is allocated: a CPU copy of the state stays resident
        between asynchronous saves (as with torch.distributed.checkpoint's async staging)."""
        return self._checkpoint.snapshot(self._global_step, self._data.state, pipelined=self.pipelined_snapshots)

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
        (a rollback after a loss spike moves on past the offending batches); an epoch-stepped LR
        scheduler is then stepped for the epochs started since the checkpoint, so it stays with the data.

        Every rank loads the same files; rank ``r`` restores ``rng[r]`` (on a TP mesh, the state its
        data-parallel rank saved: ``rng[dp_rank * rng_tp]``). A checkpoint saved by fewer ranks than
        now (an elastic resume) has no state for the new ranks: they are seeded from
        ``(ctx.seed, ctx.dp_rank, global_step)``, with a warning.

        Raises :class:`~cadence.errors.CheckpointError` (or its subclass
        ``UnsafeCheckpointError``) when a file does not match or would need unsafe unpickling.
        """
        state = dict(state or {})
        source = reader.path
        self._checkpoint.load(reader, source)
        self._checkpoint.note_mesh(state, source)
        self._global_step = int(state.get("global_step", reader.step))
        if restore_data:
            # Data position: applied when iteration (re)starts, so a running iterator is dropped. The data
            # is built and its iteration restarted now, before the RNG is restored: whatever randomness
            # that draws (a random split, a DataLoader's seed) cannot shift the stream.
            self._data.restore(self._checkpoint.rank_data_state(state, source))
        elif self.lr_scheduler is not None and self.lr_interval == "epoch":  # a rollback: the data's epochs go on
            saved = self._checkpoint.rank_data_state(state, source) or {}
            for epoch in range(int(saved.get("epoch", 0)) + 1, self._data.epoch + 1):
                if epoch % self.lr_frequency == 0:  # the epochs started since the checkpoint, as _epoch_started
                    self.lr_scheduler.step()
        if restore_rng and state.get("rng") is not None:
            self._checkpoint.restore_rng(state["rng"], source, self._global_step, int(state.get("rng_tp", 1)))
        if self.replicas is not None:  # its shard's counts of every group's positions; not the writer's RNG
            self.replicas.restored(state, data=restore_data, rng=restore_rng)
