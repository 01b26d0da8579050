"""The model an export traces: a plain callable as a module, a CPU copy in eval mode, and its
``torch.export`` program (:func:`capture_program`), shared by the formats of one export through
:class:`ExportJob`."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from cadence.errors import one_line
from cadence.torch.export.dynamic_shapes import describe_dynamic_dims, dynamic_shapes_of
from cadence.torch.export.formats import ExportError
from cadence.torch.task.export_specs import ExportSpec, SavesPretrained

log = logging.getLogger(__name__)

__all__ = ["CallableModule", "ExportJob", "capture_program", "cpu_copy", "display_name", "modes_restored", "on_cpu"]


class CallableModule(nn.Module):
    """A plain callable as a module; ``model`` (the module the callable uses, if given) is
    registered so that its weights are traced as parameters, put in eval mode and saved."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module | None) -> None:
        super().__init__()
        self.fn = fn
        self.model = model

    def forward(self, *inputs: Any) -> Any:
        return self.fn(*inputs)


def on_cpu(model: nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))


def cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on CPU; parameters and buffers are copied straight to CPU (never
    duplicated on their own device)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo).to("cpu")


def _cpu_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.detach().to("cpu") if isinstance(x, torch.Tensor) else x for x in inputs)


def display_name(model: nn.Module) -> str:
    """The class name of ``model``; a wrapped plain callable's own name."""
    if isinstance(model, CallableModule):
        return getattr(model.fn, "__name__", type(model.fn).__name__)
    return type(model).__name__


def capture_program(model: nn.Module, inputs: tuple[Any, ...], spec: ExportSpec) -> tuple[torch.export.ExportedProgram, Any]:
    """``torch.export.export`` with the spec's dynamic dims; returns (program, dynamic_shapes used or
    None). The default spec falls back to static shapes (with a warning); declared dims raise."""
    try:
        dynamic = dynamic_shapes_of(spec, inputs)
    except ValueError as e:
        raise ExportError(f"{display_name(model)}: {e}") from e
    if dynamic is not None and isinstance(model, CallableModule):
        dynamic = (dynamic,)  # forward(*inputs): one var-positional parameter
    if dynamic is not None:
        try:
            return torch.export.export(model, inputs, dynamic_shapes=dynamic), dynamic
        except Exception as e:  # constraint violations, data-dependent shapes, ...
            if spec.declares_dims:
                raise ExportError(
                    f"torch.export.export failed for {display_name(model)} with the declared dynamic dimensions "
                    f"{describe_dynamic_dims(dynamic if not isinstance(model, CallableModule) else dynamic[0])}: "
                    f"{one_line(e)} (a dimension the model computes with as a constant must stay static)"
                ) from e
            log.warning(
                "torch.export with a dynamic batch dimension failed (%s); exporting with static "
                "shapes: the exported model accepts only the example inputs' shapes",
                one_line(e),
            )
    try:
        return torch.export.export(model, inputs), None
    except Exception as e:
        raise ExportError(f"torch.export.export failed for {display_name(model)}: {e}") from e


class ExportJob:
    """One export's model and inputs; the CPU eval-mode model and the ``torch.export`` program
    are made on first use and shared by the formats."""

    def __init__(self, source: nn.Module, inputs: tuple[Any, ...] | None, spec: ExportSpec | None = None,
                 tokenizer: SavesPretrained | None = None) -> None:
        self.source = source
        self.tokenizer = tokenizer  # what the hf format saves beside the model
        self.example_inputs = inputs  # as given (None: a format that traces is not asked for)
        self.spec = spec if spec is not None else ExportSpec()
        self.weights: nn.Module = source  # whose state dict the safetensors artefact holds
        described: Any = type(source)
        if isinstance(source, CallableModule):
            described = source.fn
            self.weights = source.model if source.model is not None else source
        qualname = getattr(described, "__qualname__", type(described).__qualname__)
        self.model_class = f"{getattr(described, '__module__', None) or ''}.{qualname}"
        self._model: nn.Module | None = None
        self._program: torch.export.ExportedProgram | None = None
        self.dynamic_shapes: Any = None  # as given to torch.export (None: static)

    @property
    def model(self) -> nn.Module:
        """The model in eval mode on CPU (``source`` itself when already there, else a copy)."""
        if self._model is None:
            if not on_cpu(self.source) and isinstance(self.source, CallableModule):
                raise ExportError(
                    "a plain-callable export signature is traced on CPU and cannot be copied there: "
                    "build it on a CPU model (Task.export_signatures gets one when exported by cadence)"
                )
            self._model = self.source if on_cpu(self.source) else cpu_copy(self.source)
            self._model.eval()
        return self._model

    @property
    def inputs(self) -> tuple[Any, ...]:
        assert self.example_inputs is not None, "checked by export_model"
        return _cpu_inputs(self.example_inputs)

    def program(self) -> torch.export.ExportedProgram:
        if self._program is None:
            self._program, self.dynamic_shapes = capture_program(self.model, self.inputs, self.spec)
        return self._program

    def dynamic_info(self) -> dict[str, Any]:
        """The metadata of the program's dynamic dims: ``dynamic_batch`` (dim 0 of every tensor input
        is dynamic) and ``dynamic_dims`` (per input ``{dim: {name, min, max}}``, or null)."""
        shapes = self.dynamic_shapes
        if shapes is not None and isinstance(self.model, CallableModule):
            shapes = shapes[0]
        per_input = describe_dynamic_dims(shapes)
        tensors = [i for i, x in enumerate(self.example_inputs or ()) if isinstance(x, torch.Tensor) and x.dim() > 0]
        batch = per_input is not None and bool(tensors) and all(
            per_input[i] is not None and "0" in per_input[i] for i in tensors)  # type: ignore[operator]
        return {"dynamic_batch": batch, "dynamic_dims": per_input}


@contextlib.contextmanager
def modes_restored(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Restore the train / eval mode of every module under ``modules`` afterwards."""
    modes = {id(m): (m, m.training) for root in modules for m in root.modules()}
    try:
        yield
    finally:
        for m, training in modes.values():
            m.training = training
