"""An exponential moving average of a model's weights (``trainer.ema``): :class:`ModelEMA`.

The EMA is a :class:`~cadence.extensions.Callback` of the run (its ``on_train_step_end``), saved and
restored by the trainer that has it (``TorchTrainer(ema=...)``). It holds one copy of the
model's floating-point state (parameters and float buffers such as BatchNorm's running
statistics), on the model's device, in the model's dtypes; for a model sharded by FSDP2 each
copy is a ``DTensor`` with the parameter's placement, so every rank keeps only its shards.

**Update.** At every global step that is a multiple of ``every_n_steps`` (after the optimizer
step), one foreach operation on the device, no host sync: at a step ``<= start_step`` the EMA is
set to the weights (a copy); after it, ``ema = decay * ema + (1 - decay) * weights``
(``torch._foreach_lerp_``, the update of ``torch.optim.swa_utils.get_ema_multi_avg_fn``). The
decay applies per update, not per step: with ``every_n_steps = N`` the average's horizon is about
``N / (1 - decay)`` steps. A fresh run starts the EMA from the initial weights.

**Buffers.** Floating-point buffers (BatchNorm's ``running_mean`` / ``running_var``) are averaged
as parameters are (``swa_utils``' ``use_buffers=True``); other buffers (``num_batches_tracked``)
are not averaged: the EMA model uses the model's own. On several ranks the averages of buffers
are made rank 0's on every rank before each evaluation and save, as the model's buffers are
(:meth:`ModelEMA.buffer_averages`, :mod:`cadence.torch.parallel.replicas`).

**Tied weights.** One tensor under several names (a GPT's head tied to its embedding) has one
average, updated once per step, under each name; ``ema.safetensors`` holds it under each name too,
so a tied model loads the file with a plain ``load_state_dict(load_file(...))``.

**Checkpoints.** ``ema.safetensors`` beside ``model.safetensors``, with the same keys; in a
sharded checkpoint, DCP's top-level key ``ema`` (every rank writes its shards). A checkpoint
without an EMA starts it from its weights (a warning).

**Evaluation and export.** :meth:`ModelEMA.applied` swaps the EMA into the model in place for a
block (an evaluation, an export) and the raw weights back after it, bit for bit, one tensor at a
time: no second copy of the model.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from cadence.checkpoint.protocol import CheckpointReader
from cadence.config.components.ema import EMAConfig
from cadence.errors import CheckpointError, CheckpointMismatchError
from cadence.extensions import Callback, RunContext
from cadence.torch.checkpoint_io.kinds import is_sharded_checkpoint
from cadence.torch.checkpoint_io.pipelined import CopyJobs, StateFence
from cadence.torch.checkpoint_io.safetensors_io import SafetensorsPayload, safetensors_views
from cadence.torch.checkpoint_io.state import describe_key_mismatch, describe_shape_mismatch, unwrap_model

__all__ = ["EMA_FILE", "ModelEMA", "RAW_PREFIX", "SHARDED_KEY", "applied", "raw_metrics"]

log = logging.getLogger(__name__)

EMA_FILE = "ema.safetensors"
"""The EMA of the weights in a (not sharded) checkpoint, beside ``model.safetensors``, same keys."""
SHARDED_KEY = "ema"
"""The EMA's top-level key in a sharded (DCP) checkpoint's state."""
RAW_PREFIX = "raw/"
"""What the raw weights' metrics are named with when the EMA's are evaluated too: ``raw/<name>``."""


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its memory), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ModelEMA(Callback):
    """An EMA of ``model``'s floating-point state; see the module's docstring for the rules.

    A :class:`~cadence.extensions.Callback` that updates itself after each optimizer step
    (:meth:`on_train_step_end`): pass it in the controller's callbacks, beside the trainer that
    checkpoints it (the experiment's run does; the trainer refuses to train an EMA that is not
    registered, :attr:`attached`).

    ``model`` may be wrapped (DDP, ``torch.compile``) or sharded by FSDP2 (then the EMA's tensors
    are DTensor shards placed as the parameters). Built from the weights as they are; the trainer
    calls :meth:`reset` after initialising the model. ``settings``: how it averages (``trainer.ema``;
    None: :class:`~cadence.config.components.ema.EMAConfig`'s defaults), checked when they are built
    (``ValueError`` for ``decay`` outside (0, 1), a negative ``start_step`` or ``every_n_steps`` < 1).
    """

    def __init__(self, model: nn.Module, settings: EMAConfig | None = None) -> None:
        settings = EMAConfig() if settings is None else settings
        self.settings = settings
        self.decay = settings.decay
        self.start_step = settings.start_step
        self.every_n_steps = settings.every_n_steps
        self.evaluate_raw = settings.evaluate_raw
        self._weight = 1.0 - self.decay
        state: dict[str, torch.Tensor] = {}
        owned: set[str] = set()  # the names of the averages (the others are the model's own tensors)
        first: dict[int, str] = {}  # a tied tensor: the first name it has
        live, averaged = [], []
        module = unwrap_model(model)
        params = {id(p) for p in module.parameters()}
        buffer_averages: list[torch.Tensor] = []  # of float buffers: replicated on every rank, never sharded
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                if id(t) in first:  # tied: the same EMA tensor under both names
                    state[name] = state[first[id(t)]]
                    if first[id(t)] in owned:
                        owned.add(name)
                    continue
                first[id(t)] = name
                tensor = t.detach()
                if _is_float(tensor):
                    state[name] = tensor.clone()
                    owned.add(name)
                    live.append(_local(tensor))
                    averaged.append(_local(state[name]))
                    if id(t) not in params and state[name] is _local(state[name]):
                        buffer_averages.append(state[name])
                else:
                    state[name] = tensor  # the model's own (not averaged)
        self._state = state
        self._owned = owned
        self._live: list[torch.Tensor] = live  # the model's float tensors (local shards), in place
        self._averaged: list[torch.Tensor] = averaged  # the EMA's, in the same order
        self._buffer_averages = buffer_averages
        self.attached = False
        """Whether a controller has it among its callbacks (so that it is updated at each step)."""
        self.fence: StateFence | None = None
        """Waited for before the EMA's tensors or the model's change outside a step (:meth:`applied`,
        :meth:`reset`, a load): the trainer's, so that a pipelined snapshot's copy is done first."""

    # -- the average ---------------------------------------------------------------------------

    def attach(self, run: RunContext) -> None:
        self.attached = True

    def on_train_step_end(self, run: RunContext, step: int) -> None:
        """Update at every ``every_n_steps``-th global ``step`` (see the module)."""
        if step % self.every_n_steps or not self._averaged:
            return
        if step > self.start_step:
            torch._foreach_lerp_(self._averaged, self._live, self._weight)
        else:
            torch._foreach_copy_(self._averaged, self._live)

    def reset(self) -> None:
        """Set the EMA to the model's weights (a fresh start, or a checkpoint without an EMA)."""
        self._wait_for_copies()
        if self._averaged:
            torch._foreach_copy_(self._averaged, self._live)

    def buffer_averages(self) -> list[torch.Tensor]:
        """The EMA's averages of the model's floating-point buffers (plain tensors, one on every rank),
        for :func:`cadence.torch.parallel.replicas.sync_buffers` to make rank 0's everyone's; waits
        for a pipelined snapshot's copy of them first, since the sync writes into them."""
        self._wait_for_copies()
        return list(self._buffer_averages)

    def averaged_state(self, *, copy_model_tensors: bool = False) -> dict[str, torch.Tensor]:
        """The EMA as a state dict with the model's keys (live tensors, not copies; tied names share
        a tensor; integer buffers are the model's own, copied with ``copy_model_tensors``: the
        forward pass changes them). Under FSDP2: DTensor shards."""
        if not copy_model_tensors:
            return dict(self._state)
        return {k: t if k in self._owned else t.detach().clone() for k, t in self._state.items()}

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The EMA's weights in the model for the block, the raw weights back after it (also on
        an error), bit for bit. Swapped in place, one tensor at a time (a temporary the size of
        one tensor); no collective, so a sharded model is swapped shard by shard on every rank
        (enter it before gathering the parameters)."""
        self._wait_for_copies()
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _wait_for_copies(self) -> None:
        if self.fence is not None:
            self.fence.wait()

    def _swap(self) -> None:
        with torch.no_grad():
            for live, averaged in zip(self._live, self._averaged):
                kept = live.clone()
                live.copy_(averaged)
                averaged.copy_(kept)

    # -- checkpoints ---------------------------------------------------------------------------

    def payload(self, *, copy: bool, reuse: SafetensorsPayload | None = None,
                later: CopyJobs | None = None) -> SafetensorsPayload:
        """``ema.safetensors``'s content (see :meth:`SafetensorsPayload.from_state_dict`; ``copy``:
        for an asynchronous save, into ``reuse``'s tensors when they fit; ``later``: a pipelined
        snapshot's jobs, which copy the averages -- they change only after an optimizer step -- while
        the model's own tensors kept here, buffers the forward pass changes, are copied now)."""
        return SafetensorsPayload.from_state_dict(self._state, copy=copy, reuse=reuse, later=later,
                                                  deferred=self._owned)

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """Restore the EMA from a checkpoint whose model is already loaded: ``ema.safetensors``, or
        the ``ema`` state of a sharded checkpoint (a collective then, with a process group: every
        rank reads its shards). A checkpoint without an EMA: the EMA starts from the loaded
        weights, with a warning. ``CheckpointError`` when the saved EMA does not match the model."""
        self._wait_for_copies()
        source = reader.path
        names = reader.names()
        if is_sharded_checkpoint(names):
            # DCP is imported for sharded checkpoints only (checkpoint_io/kinds.py)
            from cadence.torch.checkpoint_io import sharded as sharded_checkpoint

            found = sharded_checkpoint.load_extra_state(source, SHARDED_KEY, self._state,
                                                        storage_options=reader.storage_options)
        elif EMA_FILE in names:
            self._load_file(reader.view(EMA_FILE), f"{source}/{EMA_FILE}" if source else EMA_FILE)
            found = True
        else:
            found = False
        if not found:
            log.warning("%s holds no EMA of the weights (saved with trainer.ema off): the EMA starts from its "
                        "weights", source or "the checkpoint")
            self.reset()

    def _load_file(self, data: memoryview, source: str) -> None:
        try:
            tensors = safetensors_views(data)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from e
        mismatch = (describe_key_mismatch(set(self._state) - set(tensors), set(tensors) - set(self._state))
                    or describe_shape_mismatch(tensors, self._state))
        if mismatch:
            raise CheckpointMismatchError(f"{source} does not match the model: {mismatch}")
        done: set[int] = set()
        with torch.no_grad():
            for name, target in self._state.items():
                if id(target) in done or not _is_float(target):  # tied: once; integer buffers: the model's
                    continue
                done.add(id(target))
                _assign(target, tensors[name])  # shapes checked above


def _assign(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` into ``target``: its shard for a DTensor (taken locally)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = _local(target)
        shard = distribute_tensor(full.to(local.device), target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(shard.to_local())
    else:
        target.copy_(full)


@contextlib.contextmanager
def applied(ema: ModelEMA | None) -> Iterator[None]:
    """:meth:`ModelEMA.applied`, or nothing for ``None`` (no EMA)."""
    if ema is None:
        yield
    else:
        with ema.applied():
            yield


def raw_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The raw weights' metrics, each name prefixed with :data:`RAW_PREFIX`."""
    return {f"{RAW_PREFIX}{key}": value for key, value in metrics.items()}
