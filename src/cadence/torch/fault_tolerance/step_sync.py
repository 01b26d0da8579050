"""One replica group's side of each fault-tolerant step (:class:`ReplicaSync`), run by
:class:`~cadence.torch.loop.trainer.TorchTrainer` when ``trainer.fault_tolerance`` is set:

1. :meth:`ReplicaSync.start_step`, before the forward pass: a quorum of the live groups through the
   lighthouse; a group behind the others (restarted, or new) heals from a live peer there
   (:mod:`~cadence.torch.fault_tolerance.healing`) and takes part in the same step -- unless the
   peer's config or world size differs from its own
   (:mod:`~cadence.torch.fault_tolerance.peer_check`): then a :class:`ConfigError` before any tensor is loaded.
2. :meth:`ReplicaSync.commit`, after the backward pass: the gradients averaged over the step's
   participants (one all-reduce of a flat buffer, which also carries the groups' data-position header:
   :mod:`~cadence.torch.fault_tolerance.positions`; at a loop's last step, every group's position), then
   torchft's commit vote. False -- a peer was
   lost in the step, or fewer than ``min_replicas`` took part -- means the optimizer must not step:
   the trainer drops the step and runs it again on its next batches.
3. :meth:`ReplicaSync.loop_logs`: ``replicas``, the fewest groups that took part in a step of the
   loop, ``replica_retries``, the loop's steps run again, and the samples skipped and read twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp

from cadence.config.components.fault_tolerance import REPLICA_ID_ENV, FaultToleranceConfig
from cadence.errors import ConfigError
from cadence.torch.fault_tolerance.healing import healing_state, load_healing_state
from cadence.torch.fault_tolerance.local_state import local_tensors
from cadence.torch.fault_tolerance.manager import build_manager, lighthouse_address, reach_lighthouse
from cadence.torch.fault_tolerance.peer_check import IDENTITY_KEY, PeerMismatchError, refusal
from cadence.torch.fault_tolerance.positions import ReplicaPositions
from cadence.torch.loop.train_data import TrainData
from cadence.torch.loop.trainer_checkpoint import TrainerParts
from cadence.torch.runtime.context import Context
from cadence.torch.task.task import Task

__all__ = ["ReplicaSync", "join_replica_groups", "replica_id_of"]

log = logging.getLogger(__name__)


def replica_id_of(config: FaultToleranceConfig) -> int:
    """This group's id: ``config.replica_id``, else ``CADENCE_REPLICA_ID``; a :class:`ConfigError`
    when neither gives an integer below ``replica_groups``."""
    if config.replica_id is not None:
        return config.replica_id
    text = os.environ.get(REPLICA_ID_ENV)
    if text is None or not text.strip().isdigit() or int(text) >= config.replica_groups:
        raise ConfigError(f"trainer.fault_tolerance: this group's id comes from trainer.fault_tolerance.replica_id or "
                          f"{REPLICA_ID_ENV}, an integer from 0 to {config.replica_groups - 1}; got {text!r}")
    return int(text)


def join_replica_groups(config: FaultToleranceConfig, ctx: Context) -> int:
    """Before the train data is built: set ``ctx.replica_group`` and ``ctx.replica_groups`` (the
    data is then split over every group's data-parallel ranks: :meth:`Context.data_shard`); return
    this group's id. A group is a job of any number of ranks (DDP, FSDP or a mesh inside it). Every
    rank first waits for the lighthouse (:func:`~cadence.torch.fault_tolerance.manager.reach_lighthouse`:
    a :class:`ConfigError` after ``connect_timeout_s``)."""
    replica_id = replica_id_of(config)
    reach_lighthouse(lighthouse_address(config), config.connect_timeout_s)
    ctx.replica_group, ctx.replica_groups = replica_id, config.replica_groups
    return ctx.replica_group


class ReplicaTrainer(TrainerParts, Protocol):
    """What :class:`ReplicaSync` reads of its trainer (a :class:`~cadence.torch.loop.trainer.TorchTrainer`)
    beyond the checkpointed parts: its task (the samples of a batch), its input's position, its step,
    and the wait for a pipelined snapshot's copy still in flight."""

    @property
    def task(self) -> Task: ...

    @property
    def input_position(self) -> TrainData: ...

    @property
    def global_step(self) -> int: ...

    def wait_for_snapshot(self) -> None: ...


class ReplicaSync:
    """Joins this replica group (``parts``: the trainer, whose context :func:`join_replica_groups`
    set) to the others -- it reaches the lighthouse now (:class:`ConfigError` when it cannot within
    ``connect_timeout_s``) -- and runs each step's quorum, gradient average and commit vote.
    ``identity``: this group's :func:`~cadence.torch.fault_tolerance.peer_check.group_identity`, sent
    to a healing peer and compared with the one a peer sends (None: nothing sent, nothing checked)."""

    def __init__(self, config: FaultToleranceConfig, parts: ReplicaTrainer,
                 identity: dict[str, Any] | None = None) -> None:
        self.config = config
        self._identity = identity
        self._refused: str | None = None  # why the peer's state was not loaded (raised after the quorum)
        self._joining = True  # before this process's first quorum, where a joining group heals
        self.replica_id = parts.ctx.replica_group
        self._parts = parts
        self._step = 0  # the global step of the step in flight (what a healing peer gets)
        self._healed: int | None = None
        self._participants: list[int] = []
        self._retries = 0
        self._consumed = 0  # the batches the running loop drew in this epoch, not yet in the train data's count
        self.positions = ReplicaPositions(parts.ctx, parts.task.batch_size_of)  # every group's data position
        ctx = parts.ctx
        self._manager, self._store = build_manager(config, self.replica_id, self._state_dict, self._load_state_dict,
                                                   rank=ctx.rank, world_size=ctx.world_size)
        log.info("replica group %d of %d joined the lighthouse%s", self.replica_id, config.replica_groups,
                 f" ({ctx.world_size} ranks)" if ctx.world_size > 1 else "")

    def _state_dict(self) -> dict[str, Any]:
        data = self._parts.input_position.state(self._consumed)
        state = {**healing_state(self._parts, self._step), "positions": self.positions.table(data)}
        if self._identity is not None:
            state[IDENTITY_KEY] = self._identity
        return state

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        if self._identity is not None:  # checked before any tensor is loaded; raised by start_step
            self._refused = refusal(self._identity, state.get(IDENTITY_KEY))
            if self._refused is not None:
                return
        self._parts.wait_for_snapshot()  # a pipelined snapshot's copy finishes before the state is replaced
        self.positions.heal(state.get("positions"), self._parts.input_position)  # before the re-seed
        self._healed = load_healing_state(self._parts, state)
        log.info("replica group %d healed from a live peer at step %d", self.replica_id, self._healed)

    def start_step(self, global_step: int, consumed: int = 0) -> int | None:
        """Before the step that ends at ``global_step + 1``: the quorum (healing included).
        ``consumed``: the batches the running loop drew in this epoch and has not added to its train
        data's count (:meth:`TrainData.state`'s ``pending``). Returns the peer's global step when this
        group healed (the trainer continues from it), else None."""
        manager = self._manager
        self._step, self._healed, self._consumed = global_step, None, consumed
        self.positions.start_step()
        if manager.current_step() != global_step:  # a resume from the model dir: torchft counts from there
            manager.load_state_dict({"step": global_step, "batches_committed": manager.batches_committed()})
        ctx = self._parts.ctx
        if self._joining and ctx.world_size > 1 and ctx.coordinator is not None:
            # Rank 0 always has a peer of its group rank to check; a rank without one (a wider group than its
            # peer's) times out in torchft (timeout_s) and would go on alone into the group's collectives:
            # the group takes rank 0's verdict, every rank at once, and torchft's errors of this quorum are
            # only logged when the group was not refused (they are the refusal's consequence, not news).
            with _held(logging.getLogger("torchft.manager")) as held:
                manager.start_quorum()
                self._refused = ctx.coordinator.broadcast(self._refused)
                held.drop = self._refused is not None
        else:
            manager.start_quorum()
        self._joining = False
        if self._refused is not None:  # the peer's state was not taken: this group leaves
            raise PeerMismatchError(self._refused)
        healed = self._healed
        if healed is not None:
            self._step = healed
        self._participants.append(manager.num_participants())
        return healed

    def commit(self, last: bool = False, consumed: int = 0) -> bool:
        """Average the gradients of the optimizer's parameters over the step's participants (the
        positions' header rides along; ``last``: the loop's last step, every group's position is
        exchanged; ``consumed`` as in :meth:`start_step`), then vote: True when every group of the
        quorum may step its optimizer. Each rank averages its own
        part (a sharded gradient's local shard) with the ranks of equal group rank in the other groups,
        which hold the same part; the gradients are already averaged inside the group (DDP, FSDP)."""
        groups = self._parts.optimizer.param_groups
        grads = [local_tensors(p.grad) for group in groups for p in group["params"] if p.grad is not None]
        dtype, device = (grads[0].dtype, grads[0].device) if grads else (torch.float32, None)
        header = self.positions.header(dtype, last).to(device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [header])
        self._manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        size = flat.numel() - header.numel()
        data = self._parts.input_position
        self.positions.exchange(flat[size:].cpu(), self._manager, lambda: data.state(consumed))
        if grads:
            flat[:size].div_(self._manager.num_participants())  # the average, as torchft's AVG does it
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        committed = bool(self._manager.should_commit())
        self.positions.end_step(committed)
        if not committed:
            self._retries += 1
            self._participants.pop()
            log.warning("replica group %d: step %d not committed (a peer was lost or too few took part); "
                        "running it again", self.replica_id, self._step + 1)
        return committed

    def loop_logs(self) -> dict[str, float]:
        """``replicas`` (the fewest participants of a committed step since the last call),
        ``replica_short_steps`` (its committed steps with fewer than ``replica_groups`` groups) and
        ``replica_retries`` (steps run again); then starts counting anew."""
        logs = {"replica_retries": float(self._retries)}
        if self._participants:
            logs["replicas"] = float(min(self._participants))
            logs["replica_short_steps"] = float(sum(n < self.config.replica_groups for n in self._participants))
        self._participants, self._retries = [], 0
        logs.update(self.positions.loop_logs())
        return logs

    def restored(self, state: dict[str, Any], *, data: bool, rng: bool) -> None:
        """After the trainer restored a checkpoint (its JSON ``state``; ``data``, ``rng``: whether
        the data position and RNG were): :meth:`ReplicaPositions.restored`."""
        self.positions.restored(state, data, rng, self._parts.global_step)

    def close(self) -> None:
        """Leave the quorum (the manager's server and transport stop)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None


class _Held(logging.Filter):
    """Holds back a logger's records (:func:`_held`); ``drop``: forget them instead of logging them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.drop = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def _held(logger: logging.Logger) -> Iterator[_Held]:
    """``logger``'s records held back inside the block, then logged unless the block set ``drop``."""
    held = _Held()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        if not held.drop:
            for record in held.records:
                logger.handle(record)
