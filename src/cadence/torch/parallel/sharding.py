"""Sharded data parallelism (``trainer.strategy: fsdp``): FSDP2's ``fully_shard`` over the
units a :class:`~cadence.torch.Task` names (:meth:`Task.fsdp_units`), then over the root.

This module knows nothing of the Task: its callers pass the units, and a function that builds a
plain model.

A sharded model stays the same module object (``fully_shard`` changes it in place), so the
trainer and the in-process evaluator share it as they share a DDP-wrapped model's module. Its
parameters are ``DTensor`` shards; what needs the whole model goes through the helpers here:

* checkpoints are sharded (:mod:`cadence.torch.checkpoint_io.sharded`: every rank writes its own
  shards through torch.distributed.checkpoint), on a gloo group of their own
  (:func:`checkpoint_group`);
* :func:`load_full_model` / :func:`load_full_optimizer`: every rank loads the full state of a
  checkpoint that is not sharded (``model.safetensors``, e.g. of a DDP run or of one process) and
  keeps its shards, cut locally (:func:`local_shards`);
* :func:`unsharded` (a collective): every unit's parameters gathered for the duration of an
  evaluation, so that forward runs no collectives (ranks may evaluate different numbers of
  batches: the shards of the validation data are unpadded).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from cadence.torch.runtime.context import Context

STRATEGIES = ("ddp", "fsdp")


def _fsdp() -> Any:
    import torch.distributed.fsdp as fsdp

    return fsdp


def check_strategy(strategy: str, precision: str) -> None:
    """``ValueError`` for an unknown strategy, or a precision it does not support (``precision``
    is a resolved name: ``"32"``, ``"bf16"`` or ``"fp16"``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use 'ddp' or 'fsdp'")
    if strategy == "fsdp" and precision == "fp16":
        raise ValueError("precision 'fp16' is not supported with strategy 'fsdp' (its grad scaler is not "
                         "sharding-aware): use precision 'bf16' or '32'")


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded by ``fully_shard``, or whose parameters are ``DTensor`` shards of a
    tensor-parallel plan (``Task.parallelize``): its checkpoints are sharded (DCP)."""
    if isinstance(model, _fsdp().FSDPModule):
        return True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_model(model: nn.Module, units: Sequence[nn.Module], ctx: Context, precision: str, *,
                declared_by: str = "fsdp_units", mesh: Any = None) -> nn.Module:
    """Apply ``fully_shard`` to each of ``units`` (submodules of ``model``, e.g.
    ``task.fsdp_units(model)``; innermost first), then to ``model``, over all ranks; ``model``
    itself, sharded in place, is returned. ``declared_by`` names where the units came from in the
    ``ValueError`` for a unit that is not in the model.

    ``precision`` ``"bf16"``: ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` (parameters all-gathered in bfloat16, gradients reduced in float32);
    ``"32"``: none. A single process shards nothing (the model is returned as it is).
    ``mesh``: the data-parallel ``DeviceMesh`` to shard over (2-D ``(dp_replicate, dp_shard)``: HSDP,
    sharded within a replica and replicated across them); None: every rank.
    """
    check_strategy("fsdp", precision)
    model = model.to(ctx.device)
    if ctx.world_size == 1:
        return model
    ctx.require_process_group("strategy 'fsdp'")
    fsdp = _fsdp()
    kwargs: dict[str, Any] = {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if precision == "bf16":
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    order = {id(m): i for i, m in enumerate(model.modules())}
    inner = []
    for unit in units:
        if id(unit) not in order:
            raise ValueError(f"{declared_by} returned a {type(unit).__name__} that is not in the model")
        if unit is not model:
            inner.append(unit)
    # modules() is pre-order: reversed, every unit comes before the units that contain it.
    for unit in sorted(inner, key=lambda m: -order[id(m)]):
        fsdp.fully_shard(unit, reshard_after_forward=True, **kwargs)
    # The root's parameters are needed first in backward: kept after forward (FSDP2's default).
    fsdp.fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def no_split_class_names(model: nn.Module) -> set[str]:
    """The class names that the ``transformers`` models in ``model`` declare as their blocks
    (``PreTrainedModel._no_split_modules``: GPT-2's ``GPT2Block``, Llama's ``LlamaDecoderLayer``)."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(type(module), "_no_split_modules", None)  # transformers' class attribute
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def default_fsdp_units(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The submodules of one of ``classes``, and those whose class a ``transformers`` model in
    ``model`` declares as its blocks (:func:`no_split_class_names`); when there are none, the
    root's direct children that have parameters."""
    blocks = no_split_class_names(model)
    units = [m for m in model.modules()
             if m is not model and (isinstance(m, classes) or type(m).__name__ in blocks)]
    if units:
        return units
    return [child for child in model.children() if any(True for _ in child.parameters())]


def checkpoint_group() -> Any:
    """Collective (every rank calls it at the same point): a new gloo group over all ranks, for
    the collectives of sharded checkpoint writes -- they may run on a background thread while
    training runs its own on the default group."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def full_copy(build_model: Callable[[], nn.Module], model: nn.Module) -> nn.Module | None:
    """Collective: the sharded ``model``'s full state gathered into a plain model built by
    ``build_model()`` (e.g. ``task.build_model``) on CPU, on rank 0 (for an export); None on the
    other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:  # not rank 0: its part is done
        return None
    from cadence.torch.runtime.rng import RNGSnapshot

    rng = RNGSnapshot()  # building draws initial weights: the training's RNG must not move (exact resume)
    plain = build_model()
    rng.restore()
    plain.load_state_dict(state)
    return plain


def local_shards(full: Any, like: Any) -> Any:
    """``full`` (a full state: tensors in nested dicts and lists) with each tensor whose counterpart
    in ``like`` (the live sharded state, of the same structure) is a ``DTensor`` replaced by this
    rank's shard of it, on that ``DTensor``'s mesh and placements (FSDP2's, TP's, HSDP's); every
    other value as it is. The shards are taken locally, with no collective: every rank holds the
    same full tensors (read from the same file), so no rank needs another's (a broadcast into a
    read-only view of a checkpoint file, as a ``Replicate`` placement's would be, cannot fail)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(full, Mapping):
        return {k: local_shards(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in full.items()}
    if isinstance(full, (list, tuple)) and isinstance(like, (list, tuple)) and len(full) == len(like):
        return type(full)(local_shards(v, w) for v, w in zip(full, like))
    if isinstance(full, torch.Tensor) and isinstance(like, DTensor) and tuple(full.shape) == tuple(like.shape):
        shard = distribute_tensor(full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)
        # its own memory: not a view of ``full`` (which may be a read-only view of a file)
        return DTensor.from_local(shard.to_local().clone(), like.device_mesh, like.placements, run_check=False,
                                  shape=shard.shape, stride=shard.stride())
    return full


def load_full_model(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (the same on every rank) into the sharded ``model`` (FSDP2, TP, HSDP):
    each rank keeps its shards (:func:`local_shards`: no collective). Strict (the caller checks the
    keys first, for a better message)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    shards = local_shards(dict(state), get_model_state_dict(model))
    set_model_state_dict(model, shards, options=StateDictOptions(strict=True))


def load_full_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full optimizer state in ``optimizer.state_dict()``'s form (keyed by parameter index, as
    a run on one process or under DDP saves it; the same on every rank) into ``optimizer`` over a
    sharded model: each state tensor of its ``DTensor`` parameter's shape (Adam's moments) is cut as
    the parameter is (:func:`local_shards`). ``ValueError`` when the groups' sizes differ."""
    groups, saved_groups = optimizer.param_groups, list(state.get("param_groups", ()))
    if [len(g["params"]) for g in groups] != [len(g.get("params", ())) for g in saved_groups]:
        raise ValueError(f"the saved parameter groups ({[len(g.get('params', ())) for g in saved_groups]} parameters) "
                         f"are not the optimizer's ({[len(g['params']) for g in groups]})")
    params = {index: param for group, saved in zip(groups, saved_groups)
              for index, param in zip(saved["params"], group["params"])}
    shards = {index: local_shards(dict(values), {name: params.get(index) for name in values})
              for index, values in state.get("state", {}).items()}
    optimizer.load_state_dict({**state, "state": shards})


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Collective on entry (every rank enters): every FSDP unit of ``model`` all-gathers its
    parameters and keeps them until exit, so that forward passes inside run no collective.
    A model that is not sharded: nothing is done."""
    if not is_sharded(model):
        yield
        return
    fsdp = _fsdp()
    units = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)  # as shard_model set it


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync()``: backward passes inside accumulate unsharded
    gradients without reduce-scattering them; the first backward after exit reduces them all.
    A model not sharded by FSDP (tensor parallelism alone) reduces nothing across data-parallel
    ranks: nothing is done."""
    if not isinstance(model, _fsdp().FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
