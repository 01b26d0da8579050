"""The smoke test's checks of what a stage produced: model state compared after a restore, and
exported artefacts run against the live model on the same inputs."""

from __future__ import annotations

import copy
import os
import math
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from cadence.errors import CadenceError

__all__ = ["SmokeCheckError", "check_export", "compare_modules", "example_inputs_of", "export_targets",
           "first_difference", "forward", "max_diff", "unwrapped"]

_EXPORT_RTOL = 1e-4  # exported graphs may fuse or reorder float ops
_EXPORT_ATOL = 1e-5


class SmokeCheckError(CadenceError):
    """A smoke-test check found something wrong (a NaN loss, a state not restored, an export
    whose outputs differ); the message says what. Raised inside a stage, never by :func:`run_smoke`."""


def check_export(label: str, directory: str, live: Any, inputs: Any, weights: nn.Module) -> list[str]:
    """Load each format of the export in ``directory`` and compare it with the live model: the
    tensors for ``safetensors``, the outputs on ``inputs`` (when given) for the others."""
    from cadence.torch.export.api import load_exported, read_export_metadata

    expected = forward(live, inputs, _device_of(live)) if inputs is not None else None
    done = []
    for fmt in read_export_metadata(directory).get("formats", {}):
        loaded = load_exported(directory, fmt)
        if fmt == "safetensors":
            where = first_difference(weights.state_dict(), loaded, "model.safetensors")
            if where is not None:
                raise SmokeCheckError(f"export {label}{fmt}: {where} differs from the live model")
            done.append(f"{label}{fmt} tensors equal")
        elif expected is None:
            done.append(f"{label}{fmt} loaded")
        else:
            diff = max_diff(expected, _run_exported(fmt, loaded, inputs), rtol=_EXPORT_RTOL, atol=_EXPORT_ATOL)
            if diff is None:
                raise SmokeCheckError(f"export {label}{fmt}: its outputs on the example inputs do not match "
                                      "the live model's in number or shape")
            if diff > 0:
                raise SmokeCheckError(f"export {label}{fmt}: its outputs on the example inputs differ from "
                                      f"the live model's beyond tolerance (max abs diff {diff:.3g})")
            done.append(f"{label}{fmt} outputs match")
    return done


def export_targets(task: Any, model: nn.Module, directory: str) -> Generator[tuple[str, str, Any, Any, nn.Module]]:
    """What to check in the export at ``directory``: ``(label, export dir, live callable, its example
    inputs or None, the module whose state dict the safetensors artefact holds)``; one per signature
    (``Task.export_signatures``, rebuilt here on a CPU copy of the model as the export did), else one."""
    from cadence.torch.export.metadata import METADATA_FILE, SIGNATURES_FILE
    from cadence.torch.export.signatures import read_signatures
    from cadence.torch.task.export_specs import ExportSignature

    if os.path.exists(os.path.join(directory, METADATA_FILE)):
        yield "", directory, model, example_inputs_of(task), model
        return
    if not os.path.exists(os.path.join(directory, SIGNATURES_FILE)):
        raise SmokeCheckError(f"no complete export under {directory} (neither {METADATA_FILE} nor {SIGNATURES_FILE})")
    cpu = model if all(t.device.type == "cpu" for t in model.state_dict().values()) else copy.deepcopy(model).cpu()
    modes = [(m, m.training) for m in cpu.modules()]
    try:
        cpu.eval()
        signatures = dict(task.export_signatures(cpu))
        listed = read_signatures(directory)["signatures"]
        for name, entry in listed.items():
            sig = signatures.get(name)
            if not isinstance(sig, ExportSignature):
                raise SmokeCheckError(f"signatures.json lists {name!r}, which Task.export_signatures() does not return")
            live = sig.module
            weights = live if isinstance(live, nn.Module) else cpu
            yield f"{name}/", os.path.join(directory, entry.get("directory", name)), live, sig.example_inputs, weights
    finally:
        for m, training in modes:
            m.training = training


# -- comparisons -------------------------------------------------------------------------------


def unwrapped(model: nn.Module) -> nn.Module:
    from cadence.torch.checkpoint_io.state import unwrap_model

    return unwrap_model(model)


def compare_modules(saved: nn.Module, restored: nn.Module) -> None:
    """Parameters and all buffers (non-persistent ones too, which a checkpoint does not hold) equal."""
    for kind, a, b in (("parameter", dict(saved.named_parameters()), dict(restored.named_parameters())),
                       ("buffer", dict(saved.named_buffers()), dict(restored.named_buffers()))):
        if a.keys() != b.keys():
            missing, extra = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
            raise SmokeCheckError(f"the restored model's {kind}s differ in name: only saved {missing}, "
                                  f"only restored {extra}")
        for name in a:
            if not _tensors_equal(a[name], b[name]):
                unsaved = kind == "buffer" and name not in saved.state_dict()
                hint = " (not in the checkpoint: a non-persistent buffer?)" if unsaved else ""
                raise SmokeCheckError(f"{kind} {name!r} differs between the saved and the restored model{hint}")


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())


def first_difference(a: Any, b: Any, path: str) -> str | None:
    """The path of the first value that differs between two nested states, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
        return None if ok else path
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return f"{path} (keys {sorted(map(str, set(a) ^ set(b)))} in one only)"
        for k in a:
            where = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if where is not None:
                return where
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            where = first_difference(x, y, f"{path}[{i}]")
            if where is not None:
                return where
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else path


def example_inputs_of(task: Any) -> tuple[Any, ...] | None:
    """``task.example_inputs()`` as a tuple, or None when the task does not define it."""
    try:
        inputs = task.example_inputs()
    except NotImplementedError:
        return None
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def forward(fn: Any, inputs: tuple[Any, ...], device: Any) -> list[torch.Tensor]:
    """``fn(*inputs)`` (a module in eval mode) without grad, RNG forked and seeded (a sampling model
    gives the same outputs each time); the output tensors flattened, on CPU. Modes are restored."""
    from cadence.torch.data.batch import move_to_device

    modes = [(m, m.training) for m in fn.modules()] if isinstance(fn, nn.Module) else []
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    try:
        if isinstance(fn, nn.Module):
            fn.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            out = fn(*move_to_device(tuple(inputs), device))
    finally:
        for m, training in modes:
            m.training = training
    return [t.detach().cpu() for t in _leaves(out)]


def _device_of(fn: Any) -> torch.device:
    """Where a module's tensors are (CPU for a plain callable or a module without tensors)."""
    if isinstance(fn, nn.Module):
        for t in (*fn.parameters(), *fn.buffers()):
            return t.device
    return torch.device("cpu")


def _leaves(out: Any) -> Iterator[Any]:
    if isinstance(out, Mapping):
        for v in out.values():
            yield from _leaves(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _leaves(v)
    elif isinstance(out, torch.Tensor):
        yield out
    elif out is None:  # an absent output (nanoGPT's ``(logits, None)`` without targets): nothing to compare
        return
    else:  # numpy arrays (onnxruntime)
        yield torch.as_tensor(out)


def _run_exported(fmt: str, loaded: Any, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    cpu = tuple(x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in inputs)
    if fmt == "onnx":
        tensors = [x for x in cpu if isinstance(x, torch.Tensor)]
        feeds = {i.name: x.numpy() for i, x in zip(loaded.get_inputs(), tensors)}
        return list(_leaves(loaded.run(None, feeds)))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [t.detach().cpu() for t in _leaves(loaded(*cpu))]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor], *, rtol: float = 0.0, atol: float = 0.0) -> float | None:
    """0.0 when every pair is within ``atol + rtol * |a|``; else the largest absolute difference;
    None when the outputs differ in number or shape."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if x.dtype.is_floating_point or y.dtype.is_floating_point:
            x, y = x.double(), y.double()
            if torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                continue
            worst = max(worst, float((x - y).abs().nan_to_num(nan=math.inf).max()))
        elif not torch.equal(x, y.to(x.dtype)):
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


# -- text --------------------------------------------------------------------------------------
