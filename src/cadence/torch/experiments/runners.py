"""Assembling the runners of a run: :func:`build_runners` builds the model, compiles it, wraps it
(DDP) or shards it (FSDP2), and builds the optimizer, LR scheduler, EMA, trainer and evaluator;
:func:`build_runners_from_config` does so as an experiment config says."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from cadence.config import ExperimentConfig
from cadence.errors import ConfigError, TaskOutputError
from cadence.torch.components.compile import compile_model
from cadence.torch.components.ema import ModelEMA
from cadence.torch.components.precision import resolve_precision
from cadence.torch.loop.evaluator import TorchEvaluator
from cadence.torch.loop.train_data import batches_per_epoch
from cadence.torch.loop.trainer import TorchTrainer
from cadence.torch.parallel import sharding
from cadence.torch.parallel.activation_checkpoint import apply_activation_checkpointing
from cadence.torch.parallel.mesh import MeshDegrees, build_mesh, resolve_degrees, strategy_degrees
from cadence.torch.experiments.task_loader import build_task
from cadence.torch.hf.pretrained import load_pretrained
from cadence.torch.runtime.context import Context
from cadence.torch.runtime.distributed import rank_env
from cadence.torch.runtime.rng import seed_everything
from cadence.torch.runtime.threads import fix_intra_op_threads
from cadence.torch.task.lr_schedule import LRSchedule, TrainingPlan
from cadence.torch.task.task import Task

if TYPE_CHECKING:
    from cadence.config.components.activation_checkpoint import ActivationCheckpointConfig
    from cadence.config.components.compile import CompileConfig
    from cadence.config.components.ema import EMAConfig
    from cadence.config.components.parallel import ParallelConfig

logger = logging.getLogger("cadence")

__all__ = ["attach_mesh", "build_runners", "build_runners_from_config", "built_model", "check_degrees"]


def built_model(task: Task) -> torch.nn.Module:
    """``task.build_model()``; :class:`~cadence.errors.TaskOutputError` (exit 2, one line naming the
    method and what it returned) when that is not a ``torch.nn.Module``."""
    model = task.build_model()
    if not isinstance(model, torch.nn.Module):
        kind = type(model)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        shown = "None" if model is None else f"a value of type {name}"
        raise TaskOutputError(f"{type(task).__name__}.build_model() returned {shown}; expected a torch.nn.Module")
    return model


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
    lr_schedule: Callable[[torch.optim.Optimizer, TrainingPlan], Any] | None = None,
    ema: EMAConfig | None = None,
    peak_tflops: float | None = None,
    log_throughput: bool = True,
    compile_config: CompileConfig | None = None,
    activation_checkpointing: ActivationCheckpointConfig | None = None,
    max_epochs: int | None = None,
    train_steps: int | None = None,
    ends_with_data: bool = False,
    pipelined_snapshots: bool = True,
    init_from_pretrained: str | None = None,
    degrees: MeshDegrees | None = None,
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
    the same sharded module. An evaluator alone (``train=False``) on several ranks with ``"fsdp"``
    shards its model the same way (each rank holds its shards; a checkpoint of any world size loads
    resharded into it): the sidecar of several ranks, ``cadence evaluate --nproc``. ``ValueError`` for
    an unknown strategy or ``precision="fp16"`` with ``"fsdp"``.

    Build order when ``train``: the model, ``task.build_optimizer(model)``, the train input
    (``task.build_inputs("train", ctx)``), then ``task.configure_lr_scheduler(optimizer, plan)`` with
    the :class:`~cadence.torch.task.lr_schedule.TrainingPlan` (the input's ``len()``,
    ``grad_accum_steps``, ``max_epochs``, ``train_steps``).
    ``lr_schedule``: builds the LR scheduler from the optimizer and the plan (the config's
    ``trainer.lr_schedule``) when the task's returns ``None``; a
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

    ``activation_checkpointing`` (``trainer.activation_checkpointing``; when ``train``): every N-th
    unit ``task.fsdp_units(model)`` names recomputes its activations in backward
    (:func:`cadence.torch.parallel.activation_checkpoint.apply_activation_checkpointing`), before
    compiling and wrapping; state-dict keys unchanged. ``None``: off.

    ``max_epochs``: the trainer's train data ends after that many epochs (``trainer.max_epochs``;
    ``None``: a re-iterable input is iterated again for as long as steps remain).
    ``train_steps``: the run's last step (``trainer.train_steps``), for the plan only.
    ``ends_with_data``: only the data's end ends training (``trainer.train_steps`` is null; see
    :class:`~cadence.torch.loop.trainer.TorchTrainer`).
    ``pipelined_snapshots``: an asynchronous save's copy runs beside the next step
    (``checkpoint.pipelined``; see :meth:`~cadence.torch.loop.trainer.TorchTrainer.snapshot_checkpoint`).
    ``init_from_pretrained``: a ``save_pretrained`` directory whose weights a fresh start loads
    before ``Task.initialize`` (``task.init_from_pretrained``; :func:`cadence.torch.hf.load_pretrained`).

    ``degrees``: the device mesh's (``trainer.parallel``, resolved; ``ctx.mesh`` set by
    :func:`attach_mesh`); it replaces ``strategy``. In torchtitan's order: ``task.parallelize(model,
    ctx.mesh["tp"])`` when ``tp > 1``, then compile, then, when training, ``fully_shard`` over the
    data-parallel mesh (``dp_replicate``, ``dp_shard``) when ``dp_shard > 1`` or ``tp > 1`` (HSDP
    with both data-parallel degrees > 1; with ``dp_shard == 1`` replicated), else DDP.
    """
    if not (train or evaluate):
        raise ValueError("build_runners: nothing to build (train=False and evaluate=False)")
    configured = degrees  # trainer.parallel's, saved in the checkpoints (None: trainer.strategy's)
    if degrees is None:
        degrees = strategy_degrees(strategy, ctx.world_size)
    else:
        if ctx.world_size > 1 and ctx.mesh is None:
            raise ValueError("build_runners: degrees given, but the context has no mesh (attach_mesh)")
        strategy = "fsdp" if degrees.dp_shard > 1 or degrees.tp > 1 else "ddp"
    sharding.check_strategy(strategy, resolve_precision(precision, ctx.device).name)
    model = built_model(task).to(ctx.device)
    if degrees.tp > 1:
        model = task.parallelize(model, ctx.mesh["tp"])
    if train and activation_checkpointing is not None:
        apply_activation_checkpointing(model, task.fsdp_units(model), activation_checkpointing.every,
                                       declared_by=f"{type(task).__name__}.fsdp_units")
    if compile_config is not None:
        compile_model(task, model, compile_config, per_unit=strategy == "fsdp" and ctx.world_size > 1 and (train or evaluate))
    trainer = None
    if train:
        # DDP's parameters are the module's own tensors: the optimizer built on the module updates
        # the wrapped model (and the task's build_optimizer may reach into the module's attributes).
        # fully_shard replaces them by DTensor shards in place: the optimizer is built after it.
        if strategy == "fsdp" and (ctx.mesh is None or degrees.dp_size > 1):
            wrapped = sharding.shard_model(model, task.fsdp_units(model), ctx, resolve_precision(precision, ctx.device).name,
                                           declared_by=f"{type(task).__name__}.fsdp_units", mesh=_dp_mesh(ctx, degrees))
        elif degrees.tp > 1:  # tensor parallelism alone: its DTensors need no data-parallel wrapper
            wrapped = model
        else:
            wrapped = ctx.wrap_model(model)
        optimizer = task.build_optimizer(model)
        train_data = task.build_inputs("train", ctx)  # before the scheduler: its length is the plan's
        plan = TrainingPlan(batches_per_epoch(train_data), grad_accum_steps, max_epochs, train_steps)
        trainer = TorchTrainer(
            task,
            wrapped,
            optimizer,
            _lr_scheduler(task, optimizer, plan, lr_schedule),
            ctx=ctx,
            train_data=train_data,
            precision=precision,
            grad_accum_steps=grad_accum_steps,
            grad_clip_norm=grad_clip_norm,
            ema=ModelEMA(wrapped, ema) if ema is not None else None,
            peak_tflops=peak_tflops,
            log_throughput=log_throughput,
            max_epochs=max_epochs,
            ends_with_data=ends_with_data,
            pipelined_snapshots=pipelined_snapshots,
            initial_weights=pretrained_loader(init_from_pretrained),
            mesh=configured,
        )
    evaluator = None
    if evaluate and not train and strategy == "fsdp" and ctx.world_size > 1 and ctx.mesh is None:
        # an evaluation of its own on several ranks (the sidecar, `cadence evaluate --nproc`): the
        # model sharded over them as training shards it; checkpoints load resharded into it
        model = sharding.shard_model(model, task.fsdp_units(model), ctx, resolve_precision(precision, ctx.device).name,
                                     declared_by=f"{type(task).__name__}.fsdp_units")
        if ctx.is_chief:
            logger.info("evaluating on %d ranks: the model sharded over them (FSDP2)", ctx.world_size)
    if evaluate:
        step_fn = (lambda: trainer.global_step) if trainer is not None else None
        if trainer is not None:
            evaluated = trainer.ema
        else:
            evaluated = ModelEMA(model, ema) if ema is not None else None
        evaluator = TorchEvaluator(task, model, ctx=ctx, precision=precision, global_step_fn=step_fn, ema=evaluated)
    return trainer, evaluator


def build_runners_from_config(cfg: ExperimentConfig, *, train: bool, evaluate: bool = True,
                       device: str | None = None, precision: str | None = None,
                       compile_model: bool = True) -> tuple[Task, Context, Any, Any]:
    """Seed, build the configured task, its context and runners: ``(task, ctx, trainer, evaluator)``.

    ``device`` / ``precision`` override ``trainer.device`` / ``trainer.precision``;
    ``compile_model=False`` ignores ``trainer.compile`` (an export only loads and traces).

    First, as it seeds, it sets this process's torch intra-op threads: 1 unless ``OMP_NUM_THREADS`` is
    set (:func:`~cadence.torch.runtime.threads.fix_intra_op_threads`), so that every layout of the same
    job (one node or several, any launcher, one process) computes the same numbers.
    """
    t = cfg.trainer
    fix_intra_op_threads()
    seed_everything(t.seed)
    task = build_task(cfg)
    if t.parallel is not None and train:  # before the process group: the launcher's WORLD_SIZE
        check_degrees(task, t.parallel, rank_env()[1])
    ctx = Context.create(device=device or t.device, seed=t.seed)
    # the mesh is training's: an evaluation or export (train=False) loads the checkpoint into a plain
    # model, sharded with FSDP2 over its ranks (1-D, no TP) when it has several and training shards
    degrees = attach_mesh(task, ctx, t.parallel) if t.parallel is not None and train else None
    strategy = t.strategy
    if not train and t.parallel is not None:
        strategy = "fsdp" if t.parallel.dp_shard != 1 or t.parallel.tp != 1 else "ddp"
    ft = t.fault_tolerance if train else None  # fault-tolerant replica groups: training's only
    if ft is not None:  # before the train data is built: it is split over every group
        from cadence.torch.fault_tolerance import join_replica_groups

        join_replica_groups(ft, ctx)
    trainer, evaluator = build_runners(
        task, ctx, precision=precision or t.precision, grad_accum_steps=t.grad_accum_steps,
        grad_clip_norm=t.grad_clip_norm, train=train, evaluate=evaluate, strategy=strategy,
        lr_schedule=_lr_schedule(cfg), ema=t.ema,
        peak_tflops=t.peak_tflops, log_throughput=t.log_throughput, compile_config=t.compile if compile_model else None,
        activation_checkpointing=t.activation_checkpointing,
        max_epochs=t.max_epochs, train_steps=t.train_steps, ends_with_data=t.train_steps is None,
        pipelined_snapshots=cfg.checkpoint.pipelined,
        init_from_pretrained=cfg.task.init_from_pretrained, degrees=degrees,
    )
    if ft is not None and trainer is not None:
        from cadence.torch.fault_tolerance import ReplicaSync
        from cadence.torch.fault_tolerance.peer_check import group_identity

        identity = group_identity(cfg, ctx.replica_group, ctx.world_size)  # what a healing peer compares
        trainer.replicas = ReplicaSync(ft, trainer, identity)  # reaches the lighthouse now
    return task, ctx, trainer, evaluator


def check_degrees(task: Task, parallel: ParallelConfig, world_size: int) -> MeshDegrees:
    """``trainer.parallel``'s degrees resolved against ``world_size`` and checked against the Task
    (:func:`~cadence.torch.parallel.mesh.resolve_degrees`: a :class:`ConfigError`, one line). No
    collective: a job checks them before its process group exists, so every rank refuses alike and
    none waits on a peer that has already left."""
    return resolve_degrees(parallel.dp_replicate, parallel.dp_shard, parallel.tp, world_size,
                           tp_divisor=task.tp_divisor, has_tp_plan=type(task).parallelize is not Task.parallelize,
                           task_name=type(task).__name__)


def attach_mesh(task: Task, ctx: Context, parallel: ParallelConfig) -> MeshDegrees:
    """:func:`check_degrees` against ``ctx.world_size`` (before anything is built); on several ranks
    the mesh is built (a collective) and set on ``ctx`` with this rank's data-parallel coordinates."""
    degrees = check_degrees(task, parallel, ctx.world_size)
    if ctx.world_size > 1:
        ctx.use_mesh(build_mesh(degrees, ctx.device.type), degrees.dp_rank(ctx.rank), degrees.dp_size)
    return degrees


def _dp_mesh(ctx: Context, degrees: MeshDegrees) -> Any:
    """The mesh FSDP shards over: None (every rank) without a device mesh; ``dp_shard`` alone when
    nothing is replicated; else the 2-D (``dp_replicate``, ``dp_shard``) mesh (HSDP)."""
    if ctx.mesh is None:
        return None
    return ctx.mesh["dp_shard"] if degrees.dp_replicate == 1 else ctx.mesh["dp_replicate", "dp_shard"]


def _lr_scheduler(task: Task, optimizer: torch.optim.Optimizer, plan: TrainingPlan,
                  lr_schedule: Callable[[torch.optim.Optimizer, TrainingPlan], Any] | None) -> Any:
    """The task's LR scheduler (``configure_lr_scheduler``), else the config's (``lr_schedule``);
    a :class:`ConfigError` when both give one."""
    scheduler = task.configure_lr_scheduler(optimizer, plan)
    if lr_schedule is None:
        return scheduler
    if scheduler is not None:
        shown = scheduler.scheduler if isinstance(scheduler, LRSchedule) else scheduler
        raise ConfigError(f"trainer.lr_schedule is set, and {type(task).__name__}.build_lr_scheduler() returns a "
                          f"{type(shown).__name__} too: remove one of them")
    return lr_schedule(optimizer, plan)


def pretrained_loader(directory: str | None) -> Callable[[torch.nn.Module], None] | None:
    """What loads a fresh start's weights from the ``save_pretrained`` ``directory`` (None: nothing)."""
    if directory is None:
        return None
    return lambda module: load_pretrained(module, directory)


def _lr_schedule(cfg: ExperimentConfig) -> Callable[[Any, TrainingPlan], Any] | None:
    """``trainer.lr_schedule`` as a function of the optimizer and the plan (None: not set): it decays
    over ``decay_steps``, else ``train_steps``, else ``max_epochs``' steps (the plan's ``total_steps``;
    a :class:`ConfigError` when the train data has no length or they are fewer than the warmup)."""
    schedule, total = cfg.trainer.lr_schedule, cfg.trainer.train_steps
    if schedule is None:
        return None
    from cadence.torch.components.lr_schedule import build_lr_schedule

    def build(optimizer: Any, plan: TrainingPlan) -> Any:
        horizon = total
        if horizon is None and schedule.decay_steps is None:
            horizon = plan.total_steps
            where = f"trainer.lr_schedule ({schedule.kind}) decays over trainer.max_epochs' steps (train_steps is null)"
            if horizon is None:
                raise ConfigError(f"{where}, but the train data has no length (len()): set trainer.train_steps or "
                                  "trainer.lr_schedule.decay_steps")
            if schedule.warmup_steps > horizon:
                raise ConfigError(f"{where}: {horizon}, fewer than trainer.lr_schedule.warmup_steps ({schedule.warmup_steps})")
        return build_lr_schedule(optimizer, schedule, total_steps=horizon)

    return build
