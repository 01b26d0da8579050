"""The layouts of a pipelined snapshot, built once and reused from save to save: the boundary's
Python per tensor is then a few passes in C over the tensors' identities (issue 29).

A pipelined snapshot (:mod:`cadence.torch.checkpoint_io.pipelined`) lists the tensors it copies
later and where each copy goes. Rebuilt at every save, that bookkeeping (the tied names of the
model's state dict, the optimizer state's containers, a copy job per tensor) was most of the
boundary's cost. :class:`ModelLayout` and :class:`OptimizerLayout` keep it; at each save they check
that the state still has the same keys and the same tensor objects (and, for the model, at the
same addresses) and hand their tensors to the copy as one batch
(:meth:`~cadence.torch.checkpoint_io.pipelined.CopyJobs.add_batch`). A layout that no longer matches
(a tensor replaced by a load or ``param.data = ...``, a module swapped, an optimizer gaining
state at its first step or for a new param group, keys added or removed) is built again, so the
snapshot is always the one :meth:`SafetensorsPayload.from_state_dict` and
:func:`~cadence.torch.checkpoint_io.pipelined.defer_tree` would build, bit for bit once written.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Container, Mapping

import torch

from cadence.torch.checkpoint_io.pipelined import CopyJobs, defer_tree
from cadence.torch.checkpoint_io.safetensors_io import SafetensorsPayload, alias_key
from cadence.torch.checkpoint_io.staging import copy_tensor

__all__ = ["ModelLayout", "OptimizerLayout", "SnapshotLayouts"]

_LEAVES = (type(None), bool, int, float, str)  # immutable values an optimizer's per-parameter state may hold


class _LastCopies:
    """What a layout made last and the copies that filled it: a snapshot that reuses that one's
    tensors reuses these copies unchecked (they are known to fit)."""

    def __init__(self) -> None:
        self._made: Any = None
        self._copies: list[torch.Tensor] | None = None

    def fitted(self, reuse: Any) -> list[torch.Tensor] | None:
        """The copies to reuse when ``reuse`` is the last thing made here, else None (checked as usual)."""
        return self._copies if reuse is not None and reuse is self._made else None

    def made(self, out: Any) -> Callable[[list[torch.Tensor]], None]:
        """``out`` is made here now; what its copies are given to once done (kept while ``out`` is the last)."""
        self._made, self._copies = out, None

        def filled(copies: list[torch.Tensor]) -> None:
            if self._made is out:
                self._copies = copies

        return filled


class ModelLayout:
    """A model state dict's layout for pipelined snapshots: its names, its tensors (the objects
    ``state_dict(keep_vars=True)`` returns, at their addresses), the tied names (aliases, as
    :meth:`SafetensorsPayload.from_state_dict` finds them), the tensors copied later (``deferred``
    names: the parameters) and those copied at the boundary (the buffers).

    Raises ``TypeError`` for an entry that is not a tensor (as ``from_state_dict`` does)."""

    def __init__(self, state_dict: Mapping[str, Any], deferred: Container[str]) -> None:
        self.names = list(state_dict)
        self.values = list(state_dict.values())
        self.addresses = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in self.values]
        self.aliases: dict[str, str] = {}
        self.sources: list[torch.Tensor] = []  # copied later: one per distinct tensor
        self.source_names: list[str] = []  # the first name of each (its copy reuses that name's tensor)
        self.slots: list[tuple[str, int]] = []  # (name, source index): where each later copy goes
        self.now: list[tuple[str, list[str]]] = []  # copied at the boundary: (name, its aliases)
        self.devices: set[torch.device] = set()
        first: dict[tuple[Any, ...], str] = {}
        later: dict[str, int] = {}  # name -> source index
        now: dict[str, list[str]] = {}
        for name, t in zip(self.names, self.values):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
            self.devices.add(t.device)
            key = alias_key(t) if t.numel() > 0 else None
            if key is not None and key in first:
                canonical = self.aliases[name] = first[key]
                if canonical in later:
                    self.slots.append((name, later[canonical]))
                else:
                    now[canonical].append(name)
                continue
            if key is not None:
                first[key] = name
            if name in deferred:
                later[name] = len(self.sources)
                self.sources.append(t)  # live: copied as it is when the copy runs
                self.source_names.append(name)
                self.slots.append((name, later[name]))
            else:
                now[name] = []
        self.now = list(now.items())
        self.plain = all(t.layout == torch.strided and not t.is_quantized for t in self.sources)
        self._last = _LastCopies()  # the last payload made here and the copies of its sources

    def matches(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether ``state_dict`` (``keep_vars=True``) has this layout's names and tensors, at their addresses."""
        return (len(state_dict) == len(self.names) and all(map(operator.is_, state_dict.values(), self.values))
                and list(state_dict) == self.names
                and [t.data_ptr() for t in self.values] == self.addresses)

    def payload(self, reuse: SafetensorsPayload | None, later: CopyJobs) -> SafetensorsPayload:
        """The snapshot's model payload: the boundary's tensors copied now, the others added to
        ``later`` as one batch (into ``reuse``'s tensors of the same names, when they fit: without a
        check when ``reuse`` is the last payload made here)."""
        previous = reuse.tensors if reuse is not None else {}
        tensors = dict(zip(self.names, self.values))  # the live tensors hold the slots until copied
        for name, aliases in self.now:
            tensors[name] = copy_tensor(tensors[name], previous.get(name))
            for alias in aliases:
                tensors[alias] = tensors[name]
        slots, names = self.slots, self.source_names
        fitted = self._last.fitted(reuse)
        made = SafetensorsPayload(tensors, dict(self.aliases))
        filled = self._last.made(made)

        def place(copies: list[torch.Tensor]) -> None:
            for name, index in slots:
                tensors[name] = copies[index]
            filled(copies)

        later.add_batch(self.sources, lambda: [previous.get(name) for name in names], place, self.devices,
                        fitted=fitted)
        return made


class OptimizerLayout:
    """An optimizer ``state_dict()``'s layout for pipelined snapshots, for the common form only:
    ``{"state": {index: {key: value}}, "param_groups": [...]}`` (plain dicts) whose per-parameter
    values are plain tensors or immutable leaves (numbers, strings, None). :meth:`of` is None for
    any other form (the caller copies it with :func:`defer_tree`)."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        state = state_dict["state"]
        rows = list(state.values())
        self.order = list(state_dict)  # "state" and "param_groups", in the optimizer's order
        self.keys = list(state)
        self.row_keys = [tuple(row) for row in rows]
        self.tensor_slots: list[tuple[int, Any]] = []  # (row, key) of each tensor, in order
        self.leaf_slots: list[tuple[int, Any]] = []
        for r, row in enumerate(rows):
            for key, value in row.items():
                (self.tensor_slots if type(value) is torch.Tensor else self.leaf_slots).append((r, key))
        self.values = [rows[r][key] for r, key in self.tensor_slots]
        self.sources: list[torch.Tensor] = []  # distinct tensors (by identity, as defer_tree dedupes)
        self.first_slots: list[tuple[Any, Any]] = []  # (state key, key) of each source's first place
        self.slots: list[tuple[int, Any, int]] = []  # (row, key, source index)
        index: dict[int, int] = {}
        for (r, key), value in zip(self.tensor_slots, self.values):
            if id(value) not in index:
                index[id(value)] = len(self.sources)
                self.sources.append(value)
                self.first_slots.append((self.keys[r], key))
            self.slots.append((r, key, index[id(value)]))
        self.devices = {t.device for t in self.sources}
        self._last = _LastCopies()  # the last state made here and the copies of its tensors

    @classmethod
    def of(cls, state_dict: Any) -> OptimizerLayout | None:
        """The layout of ``state_dict``, or None when it is not of the form this class handles."""
        if not _plain_form(state_dict) or _plain_groups(state_dict["param_groups"]) is None:
            return None
        layout = cls(state_dict)
        if any(type(state_dict["state"][layout.keys[r]][key]) not in _LEAVES for r, key in layout.leaf_slots):
            return None
        if any(t.layout != torch.strided or t.is_quantized for t in layout.sources):
            return None
        return layout

    def matches(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` has this layout's keys and tensors, and leaves where it has leaves."""
        if not _plain_form(state_dict) or list(state_dict) != self.order:
            return False
        state = state_dict["state"]
        rows = list(state.values())
        if list(state) != self.keys or [tuple(row) for row in rows] != self.row_keys:
            return False
        if not all(map(operator.is_, [rows[r][key] for r, key in self.tensor_slots], self.values)):
            return False
        return all(type(rows[r][key]) in _LEAVES for r, key in self.leaf_slots)

    def deferred(self, state_dict: dict[str, Any], reuse: Any, later: CopyJobs) -> dict[str, Any] | None:
        """What :func:`defer_tree` makes of ``state_dict`` (its tensors copied later, into those at the
        same places in ``reuse`` when they fit: unchecked when ``reuse`` is the last state made here):
        the per-parameter dicts copied now, holding their leaves as they are now, the param groups
        too; the tensors added to ``later`` as one batch. None when the param groups hold a value
        other than numbers, strings and containers (a tensor: :func:`defer_tree` then copies it all)."""
        groups = _plain_groups(state_dict["param_groups"])
        if groups is None:
            return None
        rows = [dict(row) for row in state_dict["state"].values()]  # the live tensors hold the slots until copied
        out = {part: dict(zip(self.keys, rows)) if part == "state" else groups for part in self.order}
        slots, first = self.slots, self.first_slots
        previous = reuse.get("state") if isinstance(reuse, dict) else None
        old = previous if isinstance(previous, dict) else {}
        fitted = self._last.fitted(reuse)
        filled = self._last.made(out)

        def place(copies: list[torch.Tensor]) -> None:
            for r, key, index in slots:
                rows[r][key] = copies[index]
            filled(copies)

        later.add_batch(self.sources, lambda: [_get(old.get(p), key) for p, key in first], place, self.devices,
                        fitted=fitted)
        return out


def _plain_form(state_dict: Any) -> bool:
    return (type(state_dict) is dict and state_dict.keys() == {"state", "param_groups"}
            and type(state_dict["state"]) is dict and all(type(row) is dict for row in state_dict["state"].values()))


class _NotPlain(Exception):
    pass


def _copy_plain(obj: Any) -> Any:
    """A copy of ``obj``, dicts, lists and tuples of :data:`_LEAVES`, the containers rebuilt (as
    :func:`defer_tree` rebuilds them); raises :class:`_NotPlain` when it holds anything else."""
    kind = type(obj)
    if kind in _LEAVES:
        return obj
    if kind is dict:
        return {key: _copy_plain(value) for key, value in obj.items()}
    if kind is list or kind is tuple:
        if all(type(value) in _LEAVES for value in obj):
            return kind(obj)
        return kind(_copy_plain(value) for value in obj)
    raise _NotPlain


def _plain_groups(groups: Any) -> Any:
    """:func:`_copy_plain` of an optimizer's param groups, or None when they are not plain."""
    try:
        return _copy_plain(groups)
    except (_NotPlain, RecursionError):
        return None


def _get(row: Any, key: Any) -> Any:
    return row.get(key) if isinstance(row, dict) else None


class SnapshotLayouts:
    """The layouts of one trainer's pipelined snapshots (its model's and its optimizer's), each
    rebuilt when the state no longer matches it; :meth:`clear` drops them (after a load)."""

    def __init__(self) -> None:
        self._model: ModelLayout | None = None
        self._deferred: Container[str] | None = None
        self._optimizer: OptimizerLayout | None = None

    def clear(self) -> None:
        self._model = self._optimizer = None

    def model(self, state_dict: Mapping[str, Any], deferred: Container[str], reuse: SafetensorsPayload | None,
              later: CopyJobs) -> SafetensorsPayload:
        """The model's payload of a pipelined snapshot (``state_dict``: ``keep_vars=True``;
        ``deferred``: the names copied later, a set reused from save to save): through the layout
        kept, or :meth:`SafetensorsPayload.from_state_dict` for a state with a tensor that is not
        plain (sparse, quantized)."""
        layout = self._model
        if layout is None or self._deferred is not deferred or not layout.matches(state_dict):
            layout = self._model = ModelLayout(state_dict, deferred)
            self._deferred = deferred
        if not layout.plain:
            return SafetensorsPayload.from_state_dict(state_dict, copy=True, reuse=reuse, later=later, deferred=deferred)
        return layout.payload(reuse, later)

    @property
    def model_devices(self) -> set[torch.device]:
        """The devices of the model's tensors in the last payload (none before one)."""
        return self._model.devices if self._model is not None else set()

    def optimizer(self, state_dict: Any, reuse: Any, later: CopyJobs) -> Any:
        """The optimizer state of a pipelined snapshot: :func:`defer_tree` of ``state_dict``, through
        the cached layout when the state has the common form."""
        layout = self._optimizer
        if layout is None or not layout.matches(state_dict):
            layout = self._optimizer = OptimizerLayout.of(state_dict)
        tree = layout.deferred(state_dict, reuse, later) if layout is not None else None
        return tree if tree is not None else defer_tree(state_dict, later, reuse)
