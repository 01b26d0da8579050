"""``trainer.compile``: ``torch.compile`` of the model's forward, in place, so that a checkpoint
is the same whether the run that wrote it was compiled or not.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) whose ``state_dict`` keys carry
an ``_orig_mod.`` prefix: checkpoints of compiled runs then do not load into eager models. Here the
module itself is kept and only its ``forward`` is replaced, on the instance, by a
:class:`CompiledForward` (its class's ``forward``, compiled): parameters, buffers, submodules and
``state_dict`` keys are untouched; forward hooks (FSDP2's all-gathers among them) run eagerly
around the compiled region, as they do around an ``OptimizedModule``'s.

* :func:`compile_model`: the whole model (one process, DDP: before the DDP wrap), or, for a model
  that FSDP2 shards, each unit ``Task.fsdp_units`` names (the innermost ones), before
  ``fully_shard``, as torchtitan compiles each transformer block.
* Compilation is lazy: the first forward in a new setting (training, evaluation under
  ``no_grad``, a new input shape) compiles. A failure there raises :class:`CompileError` (a
  :class:`~cadence.errors.ConfigError`: exit 2 from the CLI), one line naming the model and the
  setting that turns compilation off.
* :func:`eager_forward`: the module's own forward for the duration (exports trace it).
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from cadence.errors import ConfigError, one_line
from cadence.torch.parallel.activation_checkpoint import checkpointed_forward, is_checkpointed

if TYPE_CHECKING:
    from cadence.config.components.compile import CompileConfig
    from cadence.torch.task.task import Task

log = logging.getLogger(__name__)

__all__ = ["CompileError", "CompiledForward", "check_backend", "compile_model", "compile_module", "eager_forward",
           "is_compiled"]

TURN_OFF = "set trainer.compile: false to train eagerly"
"""How a compile failure's message says to do without compilation."""


class CompileError(ConfigError):
    """``torch.compile`` of the model failed (at its first forward in a new setting); the
    message names the model, the reason in short and :data:`TURN_OFF`. Exit status 2."""


def _forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The frame ``torch.compile`` starts from: the module's class's ``forward`` (a frame in
    ``torch.nn`` itself, ``Linear.forward``, is never one dynamo starts from: this one is ours).
    The module is an argument: modules of one class (transformer blocks) share their graphs
    instead of compiling once each."""
    return type(module).forward(module, *args, **kwargs)


def _checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """:func:`_forward` of a unit under activation checkpointing (compiled with it inside)."""
    return checkpointed_forward(module, *args, **kwargs)


_FORWARDS: dict[tuple[type, bool], Callable[..., Any]] = {}


def _forward_of(cls: type, checkpointed: bool = False) -> Callable[..., Any]:
    """:func:`_forward` (``checkpointed``: :func:`_checkpointed`) with a code object of its own for
    the modules of ``cls``: dynamo keeps its compiled graphs, and its limit on recompiling
    (``recompile_limit``, 8), per code object, so each class gets its own (training, evaluation, a
    dynamic shape) instead of sharing one."""
    if (cls, checkpointed) not in _FORWARDS:
        base = _checkpointed if checkpointed else _forward
        code = base.__code__.replace(co_name=f"{'checkpointed_' if checkpointed else ''}forward_of_{cls.__name__}")
        _FORWARDS[cls, checkpointed] = types.FunctionType(code, base.__globals__, code.co_name)
    return _FORWARDS[cls, checkpointed]


class CompiledForward:
    """A module's ``forward`` compiled with ``torch.compile``, set on the instance by
    :func:`compile_module`. Raises :class:`CompileError` when compiling fails; errors of the
    model's own code (which an eager forward raises too) pass as they are."""

    def __init__(self, module: nn.Module, compiled: Any, model_name: str) -> None:
        self.module = module
        self.compiled = compiled
        self.model_name = model_name  # the class named in a failure: the model's, not a block's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(self.module, *args, **kwargs)
        except _compile_failures() as e:
            raise CompileError(f"compiling {self.model_name} failed ({_reason(e)}): {TURN_OFF}") from e


def _compile_failures() -> tuple[type[BaseException], ...]:
    """The exceptions of dynamo and inductor that mean "could not compile". Not
    ``TorchRuntimeError``: the model's own code failed on the traced inputs, as it would eagerly."""
    from torch._dynamo import exc as dynamo_exc

    failures: list[type[BaseException]] = [dynamo_exc.Unsupported, dynamo_exc.BackendCompilerFailed,
                                           dynamo_exc.InternalTorchDynamoError, dynamo_exc.RecompileError]
    try:
        from torch._inductor.exc import InductorError

        failures.append(InductorError)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(failures)


def _reason(error: BaseException) -> str:
    """The failure in one short line: the backend's own error when it raised one."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(error, BackendCompilerFailed):
        error = error.inner_exception
    return one_line(error, limit=160)


def check_backend(name: str) -> None:
    """:class:`~cadence.errors.ConfigError` naming ``trainer.compile.backend`` when ``torch.compile``
    has no backend ``name``."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        shown = ", ".join(list_backends())  # the non-debug ones (aot_eager, eager... exist too)
        raise ConfigError(f"trainer.compile.backend: torch.compile has no backend {name!r} (e.g. {shown})")


def _torch_options(config: CompileConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": config.backend, "fullgraph": config.fullgraph, "dynamic": config.dynamic}
    if config.backend == "inductor":  # other backends take no mode (the schema refuses one)
        options["mode"] = config.mode
    return options


def _describe(config: CompileConfig) -> str:
    parts = [config.backend]
    if config.backend == "inductor" and config.mode != "default":
        parts.append(f"mode {config.mode}")
    if config.fullgraph:
        parts.append("fullgraph")
    if config.dynamic is not None:
        parts.append(f"dynamic={str(config.dynamic).lower()}")
    return ", ".join(parts)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_module` compiled ``module``'s forward (not its submodules')."""
    return isinstance(module.__dict__.get("forward"), CompiledForward)


def compile_module(module: nn.Module, config: CompileConfig, *, model_name: str | None = None) -> None:
    """Compile ``module``'s forward in place (:class:`CompiledForward`); its ``state_dict``,
    parameters and hooks stay as they are; a unit under activation checkpointing is compiled with
    it. ``model_name``: the class a failure names (default: ``module``'s). ConfigError for an
    unknown backend."""
    check_backend(config.backend)
    compiled = torch.compile(_forward_of(type(module), is_checkpointed(module)), **_torch_options(config))
    module.forward = CompiledForward(module, compiled, model_name or type(module).__name__)


def _innermost(units: list[nn.Module]) -> list[nn.Module]:
    """The units that contain no other unit (a block, not the list of blocks holding it)."""
    ids = {id(u) for u in units}
    return [u for u in units if not any(id(m) in ids for m in u.modules() if m is not u)]


def compile_model(task: Task, model: nn.Module, config: CompileConfig, *, per_unit: bool = False) -> None:
    """Compile ``model`` as ``trainer.compile`` says, in place, before it is wrapped or sharded.

    ``per_unit`` (a model FSDP2 will shard): each innermost unit of ``task.fsdp_units(model)``
    instead of the whole model; what lies outside the units (embeddings, the head) runs eagerly.

    Raises :class:`~cadence.errors.ConfigError` for an unknown backend, or when ``model`` is
    already a ``torch.compile`` wrapper (``task.build_model()`` returned ``torch.compile(m)``).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        raise ConfigError(
            f"trainer.compile is set and {type(task).__name__}.build_model() returns a torch.compile'd model: "
            "compile in one place (return the plain module, or set trainer.compile: false)"
        )
    name = type(model).__name__
    how = _describe(config)
    if not per_unit:
        compile_module(model, config, model_name=name)
        log.info("compiling %s with torch.compile (%s): at its first forward in training and in evaluation", name, how)
        return
    units = _innermost([u for u in task.fsdp_units(model) if u is not model])
    for unit in units:
        compile_module(unit, config, model_name=f"{name} ({type(unit).__name__})")
    kinds = ", ".join(sorted({type(u).__name__ for u in units}))
    log.info("compiling %s with torch.compile (%s): its %d FSDP units (%s), each at its first forward; the rest "
             "runs eagerly", name, how, len(units), kinds)


@contextlib.contextmanager
def eager_forward(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every compiled or checkpointed forward in it (its own and its submodules')
    set aside for the duration: exports trace, and copies are made of, the modules' own forwards.
    Restored after."""
    compiled = [(m, m.__dict__.pop("forward")) for m in model.modules() if is_compiled(m) or is_checkpointed(m)]
    try:
        yield model
    finally:
        for module, forward in compiled:
            module.forward = forward
