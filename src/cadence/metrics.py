"""Metric reducers: exact metrics over data sharded across processes (Determined's ``MetricReducer``).

A reducer lives in every process (every *slot*). Each one is fed this process's values with
:meth:`~MetricReducer.update` (alias :meth:`~MetricReducer.accumulate`); at the end,
:meth:`~MetricReducer.per_slot_reduce` turns what it saw into a small picklable *state*, the states
of all ranks are gathered, and :meth:`~MetricReducer.cross_slot_reduce` merges them into the value.
Because the merge sees every rank's exact contribution (sums with their weights, all the scores
for an AUC), the result is the one a single process would compute over the whole data set, for
any number of ranks and uneven shards, as long as the data is sharded without padding.

Built-ins: :class:`Mean` (weighted), :class:`Sum`, :class:`Max`, :class:`Min`, :class:`Concat`
(concatenate arrays, optionally apply ``fn`` to the result: ROC AUC, F1, ...) and
:class:`FunctionReducer` (buffer every value, apply ``fn`` once to the list from all ranks).
:func:`reduce_metrics` gathers the states of a dict of reducers with one ``all_gather``.

Tensors are accepted wherever arrays are (converted with ``.detach().cpu().numpy()``; this module
does not import torch).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from cadence.runtime.coordination import Coordinator, LocalCoordinator

__all__ = [
    "Concat",
    "FunctionReducer",
    "Max",
    "Mean",
    "MetricReducer",
    "Min",
    "Sum",
    "merge_slot_states",
    "reduce_metrics",
    "slot_states",
    "to_numpy",
]


class MetricReducer(abc.ABC):
    """The reducer protocol (Determined's ``MetricReducer``): per-slot accumulation, cross-slot merge.

    Subclass it and implement :meth:`reset`, :meth:`update`, :meth:`per_slot_reduce` and
    :meth:`cross_slot_reduce`; any object with those four methods also counts as a reducer
    (``isinstance(obj, MetricReducer)`` is true by duck-typing). A subclass written the Determined
    way, with ``accumulate`` instead of ``update``, gets ``update = accumulate``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "accumulate" in cls.__dict__ and getattr(cls.update, "__isabstractmethod__", False):
            # The alias is the point here; mypy forbids assigning to a method in general.
            cls.update = cls.__dict__["accumulate"]  # type: ignore[method-assign]

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        if cls is MetricReducer:
            names = ("reset", "update", "per_slot_reduce", "cross_slot_reduce")
            if all(any(callable(base.__dict__.get(n)) for base in other.__mro__) for n in names):
                return True
        return NotImplemented

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything accumulated (called at the start of each evaluation)."""

    @abc.abstractmethod
    def update(self, value: Any) -> None:
        """Accumulate one value (a batch's contribution) on this rank."""

    def accumulate(self, *args: Any, **kwargs: Any) -> None:
        """Alias of :meth:`update` (Determined's name)."""
        return self.update(*args, **kwargs)

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any:
        """This rank's state: picklable (numbers, numpy arrays, lists, tuples, dicts, ``None``)."""

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> Any:
        """The metric's value from every rank's :meth:`per_slot_reduce` state, in rank order."""


# -- conversion ---------------------------------------------------------------------------------


def to_numpy(value: Any, *, who: str = "reducer") -> np.ndarray:
    """``value`` (number, array-like, or a tensor by duck-typing) as a numeric numpy array."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):  # a torch.Tensor
        t = value.detach().cpu()
        try:
            return np.asarray(t.numpy())
        except (TypeError, RuntimeError):  # bfloat16 / float8 and other dtypes numpy lacks
            return np.asarray(t.float().numpy())
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{who}: expected a number, an array or a tensor, got {_describe(value)} ({e})") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{who}: expected numbers (a number, an array or a tensor), got {_describe(value)}")
    return arr


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _to_plain(value: Any) -> Any:
    """Numpy scalars and 0-d arrays as Python numbers (for logs); anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


def _convert_tree(value: Any) -> Any:
    """Tensors anywhere in tuples / lists / dicts converted to numpy; everything else unchanged."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):
        return to_numpy(value)
    if isinstance(value, tuple):
        converted = [_convert_tree(v) for v in value]
        return type(value)(*converted) if hasattr(value, "_fields") else tuple(converted)
    if isinstance(value, list):
        return [_convert_tree(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _convert_tree(v) for k, v in value.items()}
    return value


def _fsum(values: Any) -> float:
    """An accurately rounded float sum (order-independent); plain ``sum`` where infinities cancel."""
    values = [float(v) for v in values]
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf - inf, or an intermediate overflow: inf / nan as IEEE says
        return float(sum(values))


def _check_states(name: str, states: Sequence[Any]) -> list[Any]:
    if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"{name}.cross_slot_reduce expects a list of per-slot states, got {_describe(states)}")
    return list(states)


# -- built-in reducers ----------------------------------------------------------------------------


class Mean(MetricReducer):
    """The weighted mean of every value seen on every rank, with float64 sums.

    ``update(value, weight=1.0)``: ``value`` a number, array or tensor (each element counts, with
    ``weight``, a number or an array broadcastable to ``value``); ``update((value_sum, weight))``:
    an already-summed contribution, e.g. ``(correct.sum(), batch_size)``. ``nan`` when nothing
    (or only zero weight) was seen.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sum = 0.0
        self._weight = 0.0

    def update(self, value: Any, weight: Any = None) -> None:
        if isinstance(value, tuple):
            if weight is not None:
                raise TypeError(
                    "Mean.update: pass either update((value_sum, weight)) or update(value, weight=...), not both"
                )
            if len(value) != 2:
                raise TypeError(f"Mean.update: a tuple must be (value_sum, weight), got a tuple of {len(value)}")
            total = to_numpy(value[0], who="Mean.update value_sum").astype(np.float64)
            w = to_numpy(value[1], who="Mean.update weight").astype(np.float64)
            if w.size != 1:
                raise ValueError(
                    f"Mean.update: the weight of (value_sum, weight) must be a single number, got shape {w.shape}"
                )
            s, w_total = float(total.sum()), float(w.reshape(()))
        else:
            arr = to_numpy(value, who="Mean.update").astype(np.float64)
            w = np.float64(1.0) if weight is None else to_numpy(weight, who="Mean.update weight").astype(np.float64)
            try:
                w = np.broadcast_to(w, arr.shape)
            except ValueError:
                raise ValueError(
                    f"Mean.update: weight of shape {np.shape(w)} does not broadcast to value of shape {arr.shape}"
                ) from None
            if w.size and np.any(w < 0):
                raise ValueError("Mean.update: weights must be >= 0")
            s, w_total = float((arr * w).sum()), float(w.sum())
        if w_total < 0:
            raise ValueError(f"Mean.update: weights must be >= 0, got {w_total}")
        self._sum += s
        self._weight += w_total

    def per_slot_reduce(self) -> tuple[float, float]:
        return (self._sum, self._weight)

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> float:
        states = _check_states("Mean", per_slot_states)
        try:
            total = _fsum(float(s) for s, _ in states)
            weight = _fsum(float(w) for _, w in states)
        except (TypeError, ValueError):
            raise TypeError(f"Mean.cross_slot_reduce expects (sum, weight) pairs, got {states!r:.200}") from None
        return total / weight if weight else float("nan")


class Sum(MetricReducer):
    """The sum of every element of every value seen on every rank (float64)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sum = 0.0

    def update(self, value: Any) -> None:
        self._sum += float(to_numpy(value, who="Sum.update").astype(np.float64).sum())

    def per_slot_reduce(self) -> float:
        return self._sum

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> float:
        states = _check_states("Sum", per_slot_states)
        try:
            return _fsum(float(s) for s in states)
        except (TypeError, ValueError):
            raise TypeError(f"Sum.cross_slot_reduce expects numbers, got {states!r:.200}") from None


class _Extremum(MetricReducer):
    _np_fn: Callable[..., Any]

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._value: float | None = None

    def update(self, value: Any) -> None:
        arr = to_numpy(value, who=f"{type(self).__name__}.update")
        if arr.size == 0:
            return
        v = float(type(self)._np_fn(arr))
        self._value = v if self._value is None else float(type(self)._np_fn([self._value, v]))

    def per_slot_reduce(self) -> float | None:
        return self._value

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> float:
        states = [s for s in _check_states(type(self).__name__, per_slot_states) if s is not None]
        if not states:
            return float("nan")
        try:
            return float(type(self)._np_fn(np.asarray(states, dtype=np.float64)))
        except (TypeError, ValueError):
            name = type(self).__name__
            raise TypeError(f"{name}.cross_slot_reduce expects numbers or None, got {states!r:.200}") from None


class Max(_Extremum):
    """The largest element seen on any rank (``nan`` if none; a ``nan`` value propagates)."""

    _np_fn = staticmethod(np.max)


class Min(_Extremum):
    """The smallest element seen on any rank (``nan`` if none; a ``nan`` value propagates)."""

    _np_fn = staticmethod(np.min)


class Concat(MetricReducer):
    """Concatenate values along axis 0 over all batches and ranks; optionally apply ``fn``.

    ``update(array)`` (scalars count as 1-element arrays) or ``update((scores, labels, ...))``: a
    tuple of arrays, each concatenated separately. The value is the concatenation (an array, or a
    tuple of arrays), or ``fn(*concatenated)``, e.g.
    ``Concat(lambda scores, labels: roc_auc_score(labels, scores))``. Ranks are concatenated in
    rank order, so with strided shards the order is not the data set's: use ``fn`` that do not
    depend on the order. With no data at all: ``nan`` with ``fn``, an empty array without.
    """

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"Concat(fn=...): fn must be callable, got {_describe(fn)}")
        self.fn = fn
        self.reset()

    def reset(self) -> None:
        self._parts: list[list[np.ndarray]] | None = None
        self._tuple = False

    def update(self, value: Any) -> None:
        is_tuple = isinstance(value, tuple)
        values = value if is_tuple else (value,)
        if is_tuple and not values:
            raise ValueError("Concat.update: an empty tuple")
        arrays = [np.atleast_1d(to_numpy(v, who="Concat.update")) for v in values]
        if self._parts is None:
            self._parts = [[] for _ in arrays]
            self._tuple = is_tuple
        elif is_tuple != self._tuple or len(arrays) != len(self._parts):
            raise ValueError(
                f"Concat.update: got {_arity(is_tuple, len(arrays))} after {_arity(self._tuple, len(self._parts))}; "
                f"every update must have the same form"
            )
        for parts, a in zip(self._parts, arrays):
            parts.append(a)

    def per_slot_reduce(self) -> Any:
        if self._parts is None:
            return None
        joined = tuple(_concatenate(parts, i) for i, parts in enumerate(self._parts))
        return joined if self._tuple else joined[0]

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> Any:
        states = [s for s in _check_states("Concat", per_slot_states) if s is not None]
        if not states:
            return float("nan") if self.fn is not None else np.empty((0,))
        forms = {(isinstance(s, tuple), len(s) if isinstance(s, tuple) else 1) for s in states}
        if len(forms) > 1:
            raise ValueError(f"Concat.cross_slot_reduce: ranks disagree on the form of the values: {sorted(forms)}")
        is_tuple, n = forms.pop()
        columns = [[s[i] if is_tuple else s for s in states] for i in range(n)]
        joined = tuple(_concatenate([np.atleast_1d(np.asarray(a)) for a in col], i) for i, col in enumerate(columns))
        if self.fn is not None:
            return self.fn(*joined)
        return joined if is_tuple else joined[0]


def _arity(is_tuple: bool, n: int) -> str:
    return f"a tuple of {n}" if is_tuple else "an array"


def _concatenate(parts: list[np.ndarray], index: int) -> np.ndarray:
    try:
        return np.concatenate(parts, axis=0)
    except ValueError as e:
        shapes = sorted({p.shape[1:] for p in parts})
        raise ValueError(f"Concat: the values at position {index} cannot be concatenated along axis 0 "
                         f"(trailing shapes {shapes}): {e}") from None


class FunctionReducer(MetricReducer):
    """Buffer every value; the result is ``fn(values)``, applied once to the flat list of all ranks' values.

    Values are kept as given, with tensors (also inside tuples / lists / dicts) converted to numpy.
    The list is in rank order, each rank's values in the order they were seen.
    """

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionReducer(fn): fn must be callable, got {_describe(fn)}")
        self.fn = fn
        self.reset()

    def reset(self) -> None:
        self._values: list[Any] = []

    def update(self, value: Any) -> None:
        self._values.append(_convert_tree(value))

    def per_slot_reduce(self) -> list[Any]:
        return list(self._values)

    def cross_slot_reduce(self, per_slot_states: Sequence[Any]) -> Any:
        flat: list[Any] = []
        for s in _check_states("FunctionReducer", per_slot_states):
            if not isinstance(s, list):
                raise TypeError(f"FunctionReducer.cross_slot_reduce expects a list per slot, got {_describe(s)}")
            flat.extend(s)
        return self.fn(flat)

    def __repr__(self) -> str:
        return f"FunctionReducer({getattr(self.fn, '__name__', self.fn)!s})"


# -- merging across ranks ---------------------------------------------------------------------------


def _check_reducers(reducers: Mapping[str, Any]) -> None:
    if not isinstance(reducers, Mapping):
        raise TypeError(f"reducers must be a dict of name -> MetricReducer, got {_describe(reducers)}")
    for name, r in reducers.items():
        if not isinstance(r, MetricReducer):
            raise TypeError(
                f"reducer {name!r} is not a MetricReducer (needs reset, update, per_slot_reduce and "
                f"cross_slot_reduce): got {_describe(r)}"
            )


def slot_states(reducers: Mapping[str, MetricReducer]) -> dict[str, Any]:
    """This rank's ``{name: reducer.per_slot_reduce()}`` (what :func:`reduce_metrics` gathers)."""
    _check_reducers(reducers)
    return {name: r.per_slot_reduce() for name, r in reducers.items()}


def merge_slot_states(reducers: Mapping[str, MetricReducer], gathered: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{name: reducer.cross_slot_reduce([states of every rank])}`` from :func:`slot_states` of all ranks.

    Every rank must have the same reducer names (an error otherwise, raised on every rank alike).
    Numpy scalars in the results become Python numbers.
    """
    _check_reducers(reducers)
    names = list(reducers)
    for rank, states in enumerate(gathered):
        if set(states) != set(names):
            raise ValueError(
                f"the ranks have different metric reducers: rank {rank} has {sorted(states)}, this rank "
                f"has {sorted(names)}; build the same reducers on every rank"
            )
    # Computed in sorted order, the same on every rank whatever the dicts' order: a reducer's
    # cross_slot_reduce may itself be a collective (torchmetrics' compute()).
    values = {
        name: _to_plain(reducers[name].cross_slot_reduce([states[name] for states in gathered]))
        for name in sorted(names, key=str)
    }
    return {name: values[name] for name in names}


def reduce_metrics(reducers: Mapping[str, MetricReducer], coordinator: Coordinator | None = None) -> dict[str, Any]:
    """The value of every reducer over all ranks: one ``coordinator.all_gather`` of all their states.

    A collective: every rank calls it with reducers of the same names. ``coordinator``: default a
    :class:`~cadence.runtime.coordination.LocalCoordinator` (a single process).
    """
    coordinator = coordinator if coordinator is not None else LocalCoordinator()
    gathered = coordinator.all_gather(slot_states(reducers))
    return merge_slot_states(reducers, gathered)
