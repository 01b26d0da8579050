"""What a :class:`~cadence.torch.loop.trainer.TorchTrainer` writes into a checkpoint and reads back
from one: :class:`TrainerCheckpoint`.

Files: ``model.safetensors``, ``optimizer.safetensors`` (``optimizer.pt`` when the optimizer state
holds a value the safetensors form does not represent), ``ema.safetensors`` with an EMA, or a
sharded model's DCP shards (:mod:`cadence.torch.checkpoint_io.sharded`). JSON state: ``global_step``,
``rng`` (every rank's RNG state, in rank order), ``data`` (the train data's position) and, when the
ranks' positions differ, ``rank_data``. With fault-tolerant replica groups (the trainer's ``replicas``),
also every data shard's row of :mod:`cadence.torch.fault_tolerance.positions` (``replica_data``, by
shard: ``group * dp_size + dp_rank``; ``null`` for a shard never heard of), ``replica_groups`` and
``replica_writer`` (the group that saved it); a resume takes its shard's row.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from cadence.checkpoint.protocol import CheckpointReader, ShardTarget
from cadence.errors import CheckpointError
from cadence.torch.checkpoint_io.kinds import is_sharded_checkpoint
from cadence.torch.checkpoint_io.pipelined import CopyJobs, PendingCopy, StateFence
from cadence.torch.checkpoint_io import tensor_tree
from cadence.torch.checkpoint_io.shard_writes import ShardWrites
from cadence.torch.checkpoint_io.snapshot_layouts import SnapshotLayouts
from cadence.torch.checkpoint_io.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    SafetensorsPayload,
    clone_tree,
    load_model_safetensors,
    load_torch_state,
    staged,
    unwrap_model,
)
from cadence.torch.components.ema import SHARDED_KEY as EMA_KEY, ModelEMA
from cadence.torch.loop.trainer_snapshot import TrainerSnapshot
from cadence.torch.parallel import sharding
from cadence.torch.parallel.mesh import MeshDegrees
from cadence.torch.parallel.replicas import sync_buffers
from cadence.torch.runtime.context import Context
from cadence.torch.runtime.rng import get_rng_state, rank_seed, seed_everything, set_rng_state

log = logging.getLogger(__name__)

__all__ = ["TrainerCheckpoint", "TrainerParts", "shard_row"]


class TrainerParts(Protocol):
    """The parts of a trainer that its checkpoints hold; read at every save and load (so a part
    replaced on the trainer, e.g. ``trainer.lr_scheduler = None``, is the one saved)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def lr_scheduler(self) -> Any: ...

    @property
    def grad_scaler(self) -> Any: ...

    @property
    def ema(self) -> ModelEMA | None: ...

    @property
    def ctx(self) -> Context: ...

    @property
    def replicas(self) -> Any:
        """Fault-tolerant replica groups' step sync (:class:`cadence.torch.fault_tolerance.ReplicaSync`,
        whose ``positions`` every checkpoint records); None without them."""
        ...


def shard_row(state: Mapping[str, Any], shard: int) -> dict[str, Any] | None:
    """Data shard ``shard``'s row of a checkpoint's JSON ``state`` (its ``replica_data``, saved by
    fault-tolerant replica groups); None when it has none."""
    rows = state.get("replica_data")
    if not isinstance(rows, list) or not 0 <= shard < len(rows) or not isinstance(rows[shard], dict):
        return None
    return rows[shard]


class TrainerCheckpoint:
    """A trainer's checkpoint reads and writes over its ``parts``; ``sharded``: the model is
    sharded by FSDP2 over several ranks (every rank writes its shards through
    torch.distributed.checkpoint, see :class:`~cadence.torch.checkpoint_io.shard_writes.ShardWrites`).

    Keeps what one save needs between its steps: the ranks' RNG states and data positions gathered
    by :meth:`prepare` (used once), this rank's shard write, and the last asynchronous snapshot
    (whose tensors the next one reuses)."""

    def __init__(self, parts: TrainerParts, *, sharded: bool, mesh: MeshDegrees | None = None) -> None:
        self._parts = parts
        self._sharded = sharded
        self._mesh = mesh  # trainer.parallel's degrees: saved as the checkpoint's ``mesh``
        ctx = parts.ctx
        self._gathered_rng: list[dict[str, Any]] | None = None  # from prepare()
        self._gathered_data: list[dict[str, Any] | None] | None = None  # ditto: every rank's data position
        self._gathered_rows: dict[str, Any] | None = None  # ditto: every data shard's row (replica groups)
        self._staging: TrainerSnapshot | None = None  # the last asynchronous snapshot (its tensors are reused)
        self._shard_writes = ShardWrites(ctx.rank, ctx.world_size)  # a sharded model's checkpoints
        self._param_names: tuple[nn.Module, frozenset[str]] | None = None  # the model's, for pipelined snapshots
        self._layouts = SnapshotLayouts()  # pipelined snapshots' bookkeeping, kept from save to save
        self.fence = StateFence()
        """Where training waits for a pipelined snapshot's copy before the state changes."""

    # -- saving ----------------------------------------------------------------------------------

    def prepare(self, data_state: dict[str, Any] | None) -> None:
        """Collective, on every rank before the chief's save: make rank 0's buffers every rank's
        (:func:`~cadence.torch.parallel.replicas.sync_buffers`, the EMA's averages of them too),
        then gather each rank's RNG state and train-data position (``data_state``, this rank's)
        through ``ctx.coordinator``."""
        parts = self._parts
        ctx = parts.ctx
        if ctx.world_size > 1:
            sync_buffers(parts.model, parts.ema.buffer_averages() if parts.ema is not None else ())
        sync = parts.replicas  # fault-tolerant replica groups: every shard's position
        own = (get_rng_state(), data_state, sync.positions.table(data_state) if sync is not None else None)
        coord = ctx.coordinator
        gathered = coord.all_gather(own) if coord is not None and ctx.world_size > 1 else [own]
        self._gathered_rng = [rng for rng, _, _ in gathered]
        self._gathered_data = [data for _, data, _ in gathered]
        self._gathered_rows = {k: v for _, _, rows in gathered for k, v in (rows or {}).items()} if sync else None

    def write_shards(self, target: ShardTarget, *, pipelined: bool = False) -> None:
        """Collective: write this rank's shards of the model, optimizer, scheduler (and EMA) state
        into ``target.directory`` and gather every rank's files for the chief's save.

        ``pipelined`` (a background write): only the buffers -- which the next forward pass
        changes -- are copied now; the rest is copied to CPU memory on the writing thread, beside
        the next step, and :attr:`fence` waits for that copy."""
        # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
        from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

        parts = self._parts
        self.fence.wait()
        state = sharded_checkpoint.trainer_state(parts.model, parts.optimizer, parts.lr_scheduler)
        if parts.ema is not None:
            state[EMA_KEY] = parts.ema.averaged_state(copy_model_tensors=pipelined)
        if pipelined and target.background:
            buffers = {name for name, _ in unwrap_model(parts.model).named_buffers()}
            state["model"] = {k: v.detach().clone() if k in buffers else v for k, v in state["model"].items()}
        staging = self._shard_writes.write(state, target, pipelined=pipelined)
        if staging is not None:
            self.fence.hold(PendingCopy(staging))

    def wait_for_shards(self) -> None:
        """Wait for this rank's background shard write; raise a failure of any rank."""
        self._shard_writes.wait()

    def _rng_states(self) -> list[dict[str, Any]]:
        gathered, self._gathered_rng = self._gathered_rng, None  # used once: never a stale state
        if gathered is not None:
            return gathered
        ctx = self._parts.ctx
        if ctx.world_size > 1:
            log.warning(
                "save_checkpoint without prepare_checkpoint() on all ranks: only rank %d's RNG state is "
                "saved; the other ranks' RNG will be re-seeded on resume", ctx.rank,
            )
        return [get_rng_state()]

    def capture(self, global_step: int, data_state: Callable[[], dict[str, Any] | None], *, copy: bool,
                reuse: TrainerSnapshot | None = None, later: CopyJobs | None = None) -> TrainerSnapshot:
        """The checkpoint content now: the tensors as they are (``copy=False``: streamed from their
        memory by a save that follows at once) or copied to CPU memory (``copy=True``; into
        ``reuse``'s tensors when given). ``data_state``: this rank's data position, read only
        when :meth:`prepare` gathered none.

        ``later`` (with ``copy=True``): a pipelined snapshot. What the next forward pass changes
        is copied now (the buffers, the scheduler's and scaler's state; the RNG states and data
        position are taken now in any case); the parameters, the optimizer state and the EMA's
        averages, which change only at the next optimizer step or after it, are added to ``later``
        (see :mod:`cadence.torch.checkpoint_io.pipelined`)."""
        parts = self._parts
        ranks_data, self._gathered_data = self._gathered_data, None  # used once, like the RNG states
        own = ranks_data[parts.ctx.rank] if ranks_data is not None else data_state()  # not read twice
        state = {"global_step": global_step, "rng": self._rng_states(), "data": copy_module.deepcopy(own)}
        tp = parts.ctx.world_size // parts.ctx.dp_size
        if tp > 1:  # the RNG states come in TP groups of tp equal ones: a resume on another mesh finds its rank's
            state["rng_tp"] = tp
        if ranks_data is not None and any(d != state["data"] for d in ranks_data):
            state["rank_data"] = ranks_data  # per-rank loader states (a StatefulDataLoader's own shard)
        if self._mesh is not None:  # the layout it was saved on: a resume on another mesh says so
            state["mesh"] = dataclasses.asdict(self._mesh)
        rows, self._gathered_rows = self._gathered_rows, None
        sync = parts.replicas
        if sync is not None:  # every data shard's position (cadence.torch.fault_tolerance.positions)
            rows = rows if rows is not None else sync.positions.table(state["data"])
            state.update(replica_groups=parts.ctx.replica_groups, replica_writer=parts.ctx.replica_group,
                         replica_data=[rows.get(str(s)) for s in range(parts.ctx.data_shard()[1])])
        if self._sharded:
            return TrainerSnapshot(None, {}, state, shards=self._shard_writes.take())
        torch_state = {
            "optimizer": parts.optimizer.state_dict(),
            "lr_scheduler": parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None,
            "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
        }
        module = unwrap_model(parts.model)
        later = later if copy else None
        previous = reuse.model if reuse is not None else None
        if later is not None:  # through the layouts kept from the last save (snapshot_layouts)
            model = self._layouts.model(module.state_dict(keep_vars=True), self._parameter_names(module), previous, later)
        else:
            model = SafetensorsPayload.from_state_dict(module.state_dict(), copy=copy, reuse=previous)
        if copy:
            old = reuse.torch_state if reuse is not None else {}
            if later is not None:  # the optimizer's tensors change only at its next step: copied later
                optimizer = self._layouts.optimizer(torch_state.pop("optimizer"), old.get("optimizer"), later)
                torch_state = {"optimizer": optimizer, **clone_tree(torch_state, old)}
            else:
                torch_state = clone_tree(torch_state, old or None)
        ema = None
        if parts.ema is not None:
            ema = parts.ema.payload(copy=copy, reuse=reuse.ema if reuse is not None else None, later=later)
        snapshot = TrainerSnapshot(model, torch_state, state, ema=ema)
        if copy:  # CUDA tensors were copied to pinned memory without blocking: the writer waits for them
            devices = (self._layouts.model_devices if later is not None
                       else {p.device for p in parts.model.parameters()})
            snapshot.ready = staged(devices | {parts.ctx.device})
        return snapshot

    def _parameter_names(self, module: nn.Module) -> frozenset[str]:
        """``module``'s parameter names, tied ones included (computed once per module)."""
        if self._param_names is None or self._param_names[0] is not module:
            self._param_names = (module, frozenset(n for n, _ in module.named_parameters(remove_duplicate=False)))
        return self._param_names[1]

    def snapshot(self, global_step: int, data_state: Callable[[], dict[str, Any] | None], *,
                 pipelined: bool = True) -> TrainerSnapshot:
        """:meth:`capture` with ``copy=True``, into the previous snapshot's tensors once that one
        has been written (from the second asynchronous save on, no memory is allocated).

        ``pipelined``: the parameters', optimizer's and EMA's tensors are copied on a background
        thread while training goes on; training waits for that copy at :attr:`fence` (before its
        next optimizer step, a load, the EMA's swap) and the snapshot's writer waits for it too.
        False: every tensor is copied before this returns."""
        previous = self._staging if self._staging is not None and self._staging.written else None
        jobs = CopyJobs() if pipelined and not self._sharded else None
        self._staging = self.capture(global_step, data_state, copy=True, reuse=previous, later=jobs)
        if jobs is not None and len(jobs):
            self._staging.copied = self.fence.start(jobs)
        return self._staging

    # -- loading ---------------------------------------------------------------------------------

    def load(self, reader: CheckpointReader, source: str) -> None:
        """Restore the model, optimizer, scheduler, grad scaler and EMA from ``reader``'s files
        (``source``: its path, for messages). A sharded checkpoint is read collectively (DCP)
        when a process group is up: every rank reads the chunks of its shards."""
        parts = self._parts
        self.fence.wait()  # a pipelined snapshot's copy is done with the tensors about to change
        self._layouts.clear()  # the state's tensors may be new ones: the next snapshot lays them out anew
        if is_sharded_checkpoint(reader.names()):
            # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
            from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

            sharded_checkpoint.load_trainer_state(source, parts.model, parts.optimizer, parts.lr_scheduler,
                                                  storage_options=reader.storage_options)
            if parts.grad_scaler is not None:
                log.warning("%s: a sharded checkpoint holds no grad-scaler state: the fp16 loss scale starts afresh",
                            source)
        else:
            self._load_files(reader, source)
        if parts.ema is not None:
            parts.ema.load_checkpoint(reader)

    def _load_files(self, reader: CheckpointReader, source: str) -> None:
        """Restore the model, optimizer, scheduler and grad scaler from a (not sharded)
        checkpoint's ``model.safetensors`` and ``optimizer.safetensors`` / ``optimizer.pt``."""
        parts = self._parts
        model, optimizer, lr_scheduler, grad_scaler = parts.model, parts.optimizer, parts.lr_scheduler, parts.grad_scaler
        model_source = f"{source}/{MODEL_FILE}" if source else MODEL_FILE
        if self._sharded:  # each rank keeps its shards of the full tensors
            load_model_safetensors(model, reader.view(MODEL_FILE), source=model_source,
                                   load=functools.partial(sharding.load_full_model, model))
        else:
            load_model_safetensors(model, reader.view(MODEL_FILE), source=model_source)
        opt_name = OPTIMIZER_TENSORS_FILE if OPTIMIZER_TENSORS_FILE in reader.names() else OPTIMIZER_FILE
        opt_source = f"{source}/{opt_name}" if source else opt_name
        if opt_name == OPTIMIZER_TENSORS_FILE:
            # into the live optimizer's state tensors where they match: nothing to allocate and fault in
            live = None if self._sharded else {"optimizer": optimizer.state_dict()}
            opt_state = tensor_tree.load_tree(reader.view(opt_name), source=opt_source, map_location=parts.ctx.device,
                                              into=live)
        else:
            opt_state = load_torch_state(reader.read(opt_name), name=opt_name, source=source,
                                         map_location=parts.ctx.device)
        if not isinstance(opt_state, Mapping) or "optimizer" not in opt_state:
            raise CheckpointError(f"{opt_source}: expected a dict with 'optimizer'")
        try:
            if self._sharded:
                sharding.load_full_optimizer(optimizer, opt_state["optimizer"])
            else:
                optimizer.load_state_dict(opt_state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"{opt_source}: optimizer state does not match: {e}") from e
        sched_state = opt_state.get("lr_scheduler")
        if lr_scheduler is not None and sched_state is not None:
            lr_scheduler.load_state_dict(sched_state)
        elif (lr_scheduler is None) != (sched_state is None):
            log.warning("%s: LR scheduler present in %s but not in %s: not restored", source,
                        "the checkpoint" if sched_state is not None else "the trainer",
                        "the trainer" if sched_state is not None else "the checkpoint")
        scaler_state = opt_state.get("grad_scaler")
        if grad_scaler is not None and scaler_state:
            grad_scaler.load_state_dict(scaler_state)
        elif grad_scaler is not None:
            log.warning("%s: no grad-scaler state in the checkpoint: the fp16 loss scale starts afresh", source)

    def note_mesh(self, state: Mapping[str, Any], source: str) -> None:
        """On rank 0, a warning when the JSON ``state`` was saved on another device mesh (its
        ``mesh``: ``trainer.parallel``'s degrees) of the same world size (another world size has its
        own line, see :meth:`restore_rng`): the model and optimizer state were resharded, the data
        position and the RNG states are carried over as for a change of world size, and the run is
        not promised bit-identical to one that kept its mesh. Nothing for a checkpoint without a
        ``mesh`` (``trainer.strategy``'s) or on the same mesh."""
        saved, ctx, rng = state.get("mesh"), self._parts.ctx, state.get("rng")
        ranks = 1 if isinstance(rng, Mapping) else len(rng or ())  # a dict: before per-rank states
        if ctx.rank != 0 or not isinstance(saved, Mapping) or ranks != ctx.world_size:
            return
        try:
            before = MeshDegrees(**{k: int(v) for k, v in saved.items()})
        except (TypeError, ValueError):
            return
        now = self._mesh
        if now is None:  # trainer.strategy's 1-D mesh
            now = MeshDegrees(dp_shard=ctx.world_size) if self._sharded else MeshDegrees(dp_replicate=ctx.world_size)
        if before != now:
            log.warning(
                "%s: saved on the mesh %s, resumed on %s: the model and optimizer state are resharded, the data "
                "position kept (in global samples with a resumable loader) and the RNG states carried over as for a "
                "change of world size, but the run is not promised to be bit-identical to one that kept its mesh",
                source or "checkpoint", before.describe(), now.describe(),
            )

    def rank_data_state(self, state: Mapping[str, Any], source: str) -> Any:
        """This rank's data position in the JSON ``state``: in a replica group, its data shard's row
        of ``replica_data`` when there is one; its own when the ranks' differ (``rank_data``: a loader
        whose state is per rank, such as torchdata's ``StatefulDataLoader``), else ``data``."""
        ctx = self._parts.ctx
        if ctx.replica_groups > 1 and isinstance(state.get("replica_data"), list):
            shard = ctx.data_shard()[0]
            row = shard_row(state, shard)
            if row is not None:
                return row.get("data")
            log.warning("%s: no data position saved for data shard %d (replica group %d): it starts its data "
                        "from the start", source or "checkpoint", shard, ctx.replica_group)
            return None
        ranks = state.get("rank_data")
        if not isinstance(ranks, list) or not ranks:
            return state.get("data")
        rank, world_size = self._parts.ctx.rank, self._parts.ctx.world_size
        if len(ranks) != world_size and rank == 0:
            log.warning(
                "%s: the train data's position is per rank (its loader's own state, e.g. a StatefulDataLoader) and was "
                "saved by %d rank(s), resumed on %d: each rank continues from the saved state of the rank with its "
                "number (or rank 0's), so samples may be repeated or skipped; a cadence.torch.ResumableLoader keeps "
                "its position in global samples across world sizes", source or "checkpoint", len(ranks), world_size,
            )
        return ranks[rank] if rank < len(ranks) else state.get("data")

    def restore_rng(self, saved: Any, source: str, global_step: int, saved_tp: int = 1) -> None:
        """Restore this rank's RNG state from ``saved`` (the checkpoint's ``rng``, one per rank, saved
        on a mesh of tensor-parallel degree ``saved_tp``, the checkpoint's ``rng_tp``): that of the
        saving rank with this rank's data-parallel rank (``dp_rank * saved_tp``; without TP, its own
        rank), so that the ranks of a TP group draw the same numbers and each data-parallel rank
        keeps its stream on any mesh. A rank with none saved (an elastic resume) is seeded from
        ``(ctx.seed, ctx.dp_rank, global_step)``, with a warning."""
        ctx = self._parts.ctx
        states = [saved] if isinstance(saved, Mapping) else list(saved)  # a dict: before per-rank states
        rank, world_size = ctx.rank, ctx.world_size
        source_rank = ctx.dp_rank * max(1, saved_tp)  # the first rank of the saving TP group: rank itself without TP
        if source_rank < len(states):
            set_rng_state(states[source_rank])
        else:
            seed = rank_seed(ctx.seed, ctx.dp_rank, global_step)
            log.warning(
                "%s: the checkpoint holds the RNG states of %d rank(s), none for rank %d of %d (an elastic "
                "resume): its RNG is seeded from (seed=%d, dp_rank=%d, global_step=%d) instead",
                source or "checkpoint", len(states), rank, world_size, ctx.seed, ctx.dp_rank, global_step,
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
