"""The export declarations a :class:`~cadence.torch.Task` returns: :class:`ExportSpec` (dynamic
dimensions and ONNX names), :class:`ExportSignature` (one named inference entry point) and
:class:`SavesPretrained` (the tokenizer an ``hf`` export saves).

They are plain values, checked on construction; the exporter (:mod:`cadence.torch.export`) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

__all__ = ["DimSpec", "ExportSignature", "ExportSpec", "SavesPretrained", "as_inputs", "dim_bounds"]


@runtime_checkable
class SavesPretrained(Protocol):
    """What :meth:`Task.export_tokenizer` returns: a tokenizer (or processor) that writes its files into
    a directory, as ``transformers``' ``PreTrainedTokenizerBase.save_pretrained`` does."""

    def save_pretrained(self, save_directory: str) -> Any:
        """Write the files ``from_pretrained(save_directory)`` reads."""


def as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    """Example inputs as a tuple (a lone tensor is wrapped); ``None`` stays ``None``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of tensors for model(*inputs), "
        f"got {type(example_inputs).__name__}"
    )


DimSpec = Any
"""One dynamic dimension in :attr:`ExportSpec.dynamic_dims`: a name (``"seq"``, unbounded), a
tuple ``(name, min, max)`` (either bound may be ``None``), or a ``torch.export.Dim``."""


@dataclass(frozen=True)
class ExportSpec:
    """How the traced export formats see a model's inputs and outputs (see :meth:`Task.export_spec`,
    :class:`~cadence.torch.ExportSignature`'s ``spec``).

    ``dynamic_dims``: one entry per example input, ``None`` (or ``{}``) for an input whose shape is
    fixed, else ``{dim_index: dim}`` with ``dim`` a name (``"seq"``), ``(name, min, max)`` (a bound
    may be ``None``) or a ``torch.export.Dim``; a name used in several places is one size (e.g.
    the batch of two inputs). ``None`` (the default): dim 0 of every tensor input is one dynamic
    ``"batch"`` dimension, and the export falls back to static shapes (with a warning) when the
    model cannot be exported so; declared dimensions never fall back: the export fails, naming
    them. ``torch_export`` and ``onnx`` use them (``torch.export``'s ``dynamic_shapes``; ONNX names
    its dimensions after them); a ``torchscript`` trace cannot (it records what it saw).

    ``input_names`` / ``output_names``: the ONNX graph's input and output names (one per tensor
    input, one per output tensor); ``None``: the exporter's (the ``forward`` argument names).

    Raises ``TypeError`` / ``ValueError`` for a malformed declaration; checking it against the
    example inputs (:func:`dynamic_shapes_of`) raises ``ValueError`` naming the input and dim.
    """

    dynamic_dims: Sequence[Mapping[int, DimSpec] | None] | None = None
    input_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        dims = self.dynamic_dims
        if dims is not None:
            if isinstance(dims, (str, bytes, Mapping)) or not isinstance(dims, Sequence):
                raise TypeError(
                    f"ExportSpec.dynamic_dims must be a list with one entry per input (None, or "
                    f"{{dim_index: name | (name, min, max) | torch.export.Dim}}), got {type(dims).__name__}"
                )
            for i, entry in enumerate(dims):
                if entry is not None and not isinstance(entry, Mapping):
                    raise TypeError(f"ExportSpec.dynamic_dims[{i}] must be None or a mapping of dim index to "
                                    f"dimension, got {type(entry).__name__}")
                for d, dim in (entry or {}).items():
                    if isinstance(d, bool) or not isinstance(d, int):
                        raise TypeError(f"ExportSpec.dynamic_dims[{i}]: dim indices are integers, got {d!r}")
                    dim_bounds(dim, f"ExportSpec.dynamic_dims[{i}][{d}]")
            object.__setattr__(self, "dynamic_dims", tuple(None if e is None else dict(e) for e in dims))
        for field in ("input_names", "output_names"):
            names = getattr(self, field)
            if names is None:
                continue
            if isinstance(names, str) or not isinstance(names, Sequence) or not all(
                    isinstance(n, str) and n for n in names):
                raise TypeError(f"ExportSpec.{field} must be a list of non-empty strings, got {names!r}")
            if len(set(names)) != len(names):
                raise ValueError(f"ExportSpec.{field} has duplicate names: {list(names)}")
            object.__setattr__(self, field, tuple(names))

    @property
    def declares_dims(self) -> bool:
        """Whether the dynamic dimensions are declared (not the default dynamic batch)."""
        return self.dynamic_dims is not None


def dim_bounds(dim: DimSpec, where: str) -> tuple[str, int | None, int | None] | None:
    """``(name, min, max)`` of a declared dimension; ``None`` for a ``torch.export.Dim`` (its own)."""
    if isinstance(dim, str):
        dim = (dim, None, None)
    if isinstance(dim, tuple):
        if len(dim) == 1:
            dim = (dim[0], None, None)
        if len(dim) != 3 or not isinstance(dim[0], str) or not dim[0].isidentifier():
            raise ValueError(f"{where}: expected a name, (name, min, max) or a torch.export.Dim, got {dim!r} "
                             f"(names are identifiers)")
        name, lo, hi = dim
        for bound in (lo, hi):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise ValueError(f"{where}: bounds are integers >= 0 or None, got {dim!r}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{where}: min {lo} is above max {hi}")
        return name, lo, hi
    if type(dim).__module__.startswith("torch") and hasattr(dim, "__name__"):
        return None
    raise ValueError(f"{where}: expected a name, (name, min, max) or a torch.export.Dim, got {dim!r}")


@dataclass(frozen=True, eq=False)
class ExportSignature:
    """One named inference entry point of an export (see :meth:`Task.export_signatures`).

    ``module``: an ``nn.Module``, or a plain callable of tensors (e.g. ``lambda x:
    model(x).softmax(-1)``), which is wrapped into an ``nn.Module`` at export so that every
    format works. The ``safetensors`` artefact of a signature is its module's ``state_dict()``;
    for a plain callable it is the state dict of the model it is exported with (the ``model``
    given to :func:`export_model_signatures`: the trained model, when exported from a Task), and
    empty without one.

    ``example_inputs``: a tensor or a tuple of tensors for ``module(*inputs)``, batch dimension
    first with batch size >= 2 (kept as a tuple); needed by the traced formats (``torch_export``,
    ``torchscript``, ``onnx``), ``None`` when only ``safetensors`` is exported.

    ``spec``: the signature's dynamic dimensions and ONNX input / output names
    (:class:`~cadence.torch.ExportSpec`); ``None``: a dynamic batch dimension (the default spec).

    Raises ``TypeError`` when ``module`` is not callable, ``example_inputs`` is not tensors or
    ``spec`` is not an ``ExportSpec``.
    """

    module: nn.Module | Callable[..., Any]
    example_inputs: tuple[Any, ...] | None = None
    spec: ExportSpec | None = None

    def __post_init__(self) -> None:
        if not callable(self.module):
            got = type(self.module).__name__
            raise TypeError(f"ExportSignature.module must be an nn.Module or a callable, got {got}")
        if self.spec is not None and not isinstance(self.spec, ExportSpec):
            raise TypeError(f"ExportSignature.spec must be an ExportSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "example_inputs", as_inputs(self.example_inputs))
