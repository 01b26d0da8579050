"""The dynamic dimensions of a traced export: ``torch.export``'s ``dynamic_shapes`` from an
:class:`~cadence.torch.task.export_specs.ExportSpec` and the example inputs, checked against them,
and described as JSON for ``metadata.json``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from cadence.torch.task.export_specs import ExportSpec, dim_bounds

log = logging.getLogger(__name__)

__all__ = ["check_spec", "describe_dynamic_dims", "dynamic_shapes_of"]


def _dynamic_batch_shapes(inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``dynamic_shapes`` with one shared batch dim (dim 0 of every tensor input), or ``None``
    (with a warning) when the inputs cannot give one."""
    sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1 or min(sizes) < 2:
        log.warning(
            "example inputs have batch sizes %s: need one batch size >= 2 for a dynamic batch "
            "dimension; exporting with static shapes",
            sorted(sizes),
        )
        return None
    batch = torch.export.Dim("batch")
    return tuple({0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs)


def dynamic_shapes_of(spec: ExportSpec, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``torch.export``'s ``dynamic_shapes`` for ``inputs`` (one entry per input) as ``spec``
    declares them; ``None``: no dynamic dimension. The default spec gives the shared batch dim
    (``None``, with a warning, when the inputs cannot have one).

    Raises ``ValueError`` (naming the input and dim) for a declaration that does not fit the
    example inputs: another number of entries than inputs, a dim the input does not have, an
    example size outside the declared bounds or below 2 (``torch.export`` takes sizes 0 and 1
    for constants), or one name with two different bounds.
    """
    if spec.dynamic_dims is None:
        return _dynamic_batch_shapes(inputs)
    declared = spec.dynamic_dims
    if len(declared) != len(inputs):
        raise ValueError(f"ExportSpec.dynamic_dims has {len(declared)} entries for {len(inputs)} example inputs: "
                         f"give one per input (None for an input of fixed shape)")
    dims: dict[str, Any] = {}
    bounds: dict[str, tuple[int | None, int | None]] = {}
    shapes: list[Any] = []
    for i, (x, entry) in enumerate(zip(inputs, declared)):
        if not entry:
            shapes.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"ExportSpec.dynamic_dims[{i}]: example input {i} is a {type(x).__name__}, not a tensor")
        shape: dict[int, Any] = {}
        for d, dim in entry.items():
            where = f"ExportSpec.dynamic_dims[{i}][{d}]"
            index = d + x.dim() if d < 0 else d
            if not 0 <= index < x.dim():
                raise ValueError(f"{where}: example input {i} has {x.dim()} dims (shape {list(x.shape)})")
            size = int(x.shape[index])
            parsed = dim_bounds(dim, where)
            if parsed is None:  # a torch.export.Dim of the caller's
                name = dim.__name__
                lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
                dims.setdefault(name, dim)
            else:
                name, lo, hi = parsed
                if name in bounds and bounds[name] != (lo, hi):
                    raise ValueError(f"{where}: dimension {name!r} is declared with bounds {bounds[name]} and "
                                     f"{(lo, hi)}")
                if name not in dims:
                    dims[name] = torch.export.Dim(name, **{k: v for k, v in (("min", lo), ("max", hi)) if v is not None})
            bounds.setdefault(name, (lo, hi))
            if size < 2:
                raise ValueError(f"{where}: dimension {name!r} has size {size} in example input {i}; torch.export "
                                 f"takes sizes 0 and 1 for constants: give an example of size >= 2")
            if (lo is not None and size < lo) or (hi is not None and size > hi):
                raise ValueError(f"{where}: example input {i} has size {size} there, outside {name!r}'s bounds "
                                 f"[{lo}, {hi}]")
            shape[index] = dims[name]
        shapes.append(shape)
    if spec.input_names is not None:
        tensors = sum(isinstance(x, torch.Tensor) for x in inputs)
        if len(spec.input_names) != tensors:
            raise ValueError(f"ExportSpec.input_names names {len(spec.input_names)} inputs, the example inputs "
                             f"hold {tensors} tensors")
    return tuple(shapes) if any(s for s in shapes) else None


def check_spec(spec: ExportSpec, inputs: tuple[Any, ...]) -> None:
    """``ValueError`` when ``spec`` does not fit ``inputs`` (see :func:`dynamic_shapes_of`); the default
    spec always does (it falls back to static shapes)."""
    if spec.declares_dims or spec.input_names is not None:
        dynamic_shapes_of(spec if spec.declares_dims else ExportSpec(dynamic_dims=[None] * len(inputs),
                                                                     input_names=spec.input_names), inputs)


def describe_dynamic_dims(shapes: tuple[Any, ...] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """``dynamic_shapes`` as JSON for ``metadata.json``: per input ``{dim: {name, min, max}}``."""
    if shapes is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for shape in shapes:
        if not shape:
            out.append(None)
            continue
        described = {}
        for d, dim in shape.items():
            lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
            described[str(d)] = {"name": dim.__name__, "min": lo if isinstance(lo, int) else None,
                                 "max": hi if isinstance(hi, int) and hi < 2**62 else None}
        out.append(described)
    return out
