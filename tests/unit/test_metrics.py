"""cadence.metrics: reducer semantics, merges over simulated slots, reduce_metrics, errors (no processes)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from cadence.runtime.coordination import LocalCoordinator
from cadence.metrics import (
    Concat,
    FunctionReducer,
    Max,
    Mean,
    MetricReducer,
    Min,
    Sum,
    merge_slot_states,
    reduce_metrics,
    slot_states,
)



def roc_auc_score(labels, scores) -> float:
    """scikit-learn's, imported on first use: its import takes seconds of every pytest worker's collection."""
    from sklearn.metrics import roc_auc_score as auc

    return auc(labels, scores)


RNG = np.random.default_rng(0)
VALUES = RNG.normal(size=1001) * 10 + 3
LABELS = (RNG.random(1001) < 0.4).astype(np.int64)
SCORES = RNG.random(1001) + 0.3 * LABELS


def batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def strided(n: int, slots: int) -> list[np.ndarray]:
    """Unpadded strided shards, as ctx.wrap_dataset makes them (uneven for 1001 % slots != 0)."""
    return [np.arange(r, n, slots) for r in range(slots)]


def run_slots(make, feed, slots: int, batch_size: int = 37):
    """Feed each slot's shard in batches to its own reducer; merge the pickled states like all_gather."""
    reducers = [make() for _ in range(slots)]
    for r, idx in zip(reducers, strided(len(VALUES), slots)):
        for b in batches(len(idx), batch_size):
            feed(r, idx[b])
    states = [pickle.loads(pickle.dumps(r.per_slot_reduce())) for r in reducers]
    return reducers[0].cross_slot_reduce(states)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_mean_sum_max_min_over_uneven_slots_equal_unsplit(slots):
    w = RNG.random(1001)
    cases = [
        (Mean, lambda r, i: r.update(VALUES[i]), VALUES.mean()),
        (Mean, lambda r, i: r.update((VALUES[i].sum(), len(i))), VALUES.mean()),  # (value_sum, weight)
        (Mean, lambda r, i: r.update(float(VALUES[i].mean()), weight=len(i)), VALUES.mean()),  # batch means
        (Mean, lambda r, i: r.update(VALUES[i], weight=w[i]), np.average(VALUES, weights=w)),
        (Mean, lambda r, i: r.accumulate(torch.from_numpy(VALUES[i])), VALUES.mean()),  # tensors, alias
        (Sum, lambda r, i: r.update(VALUES[i]), VALUES.sum()),
        (Sum, lambda r, i: r.update(torch.from_numpy(LABELS[i])), LABELS.sum()),
        (Max, lambda r, i: r.update(VALUES[i]), VALUES.max()),
        (Min, lambda r, i: r.update(torch.from_numpy(VALUES[i])), VALUES.min()),
    ]
    for make, feed, expected in cases:
        got = run_slots(make, feed, slots)
        assert isinstance(got, float)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), (make.__name__, slots)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_concat_with_fn_and_function_reducer_equal_unsplit(slots):
    expected = roc_auc_score(LABELS, SCORES)
    auc = run_slots(lambda: Concat(lambda s, y: roc_auc_score(y, s)),
                    lambda r, i: r.update((SCORES[i], LABELS[i])), slots)
    assert auc == pytest.approx(expected, abs=1e-12)

    calls = []

    def fn(values):
        calls.append(len(values))
        s = np.concatenate([v[0] for v in values])
        y = np.concatenate([v[1] for v in values])
        return roc_auc_score(y, s)

    feed = lambda r, i: r.update((torch.from_numpy(SCORES[i]), torch.from_numpy(LABELS[i])))  # noqa: E731
    assert run_slots(lambda: FunctionReducer(fn), feed, slots, batch_size=50) == pytest.approx(expected, abs=1e-12)
    n_batches = sum(len(batches(len(idx), 50)) for idx in strided(1001, slots))
    assert calls == [n_batches]  # once, on the flat list of every batch of every slot


def test_concat_values_and_forms():
    c = Concat()
    c.update(np.arange(3))
    c.update(torch.tensor([3, 4]))
    c.update(5)  # a scalar is one element
    assert c.per_slot_reduce().tolist() == [0, 1, 2, 3, 4, 5]
    other = Concat()
    other.update(np.array([6.0]))
    merged = c.cross_slot_reduce([c.per_slot_reduce(), None, other.per_slot_reduce()])  # None: an empty slot
    assert merged.tolist() == [0, 1, 2, 3, 4, 5, 6]

    pairs = Concat()
    pairs.update((np.zeros((2, 3)), np.array([1, 2])))
    pairs.update((np.ones((1, 3)), np.array([3])))
    x, y = pairs.cross_slot_reduce([pairs.per_slot_reduce()])
    assert x.shape == (3, 3) and y.tolist() == [1, 2, 3]

    assert np.isnan(Concat(fn=len).cross_slot_reduce([None, None]))
    assert Concat().cross_slot_reduce([None]).shape == (0,)

    with pytest.raises(ValueError, match="same form"):
        pairs.update(np.zeros(3))
    with pytest.raises(ValueError, match="same form"):
        pairs.update((np.zeros(3), np.zeros(3), np.zeros(3)))
    with pytest.raises(ValueError, match="disagree on the form"):
        Concat().cross_slot_reduce([np.zeros(2), (np.zeros(2), np.zeros(2))])
    bad = Concat()
    bad.update(np.zeros((2, 3)))
    bad.update(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="cannot be concatenated along axis 0"):
        bad.per_slot_reduce()
    with pytest.raises(TypeError, match="fn must be callable"):
        Concat(fn=3)


def test_function_reducer_keeps_values_and_converts_tensors():
    f = FunctionReducer(lambda values: values)
    f.update(1.5)
    f.update({"x": torch.tensor([1, 2])})
    g = FunctionReducer(lambda values: values)
    g.update((torch.tensor(3.0), "label"))
    out = f.cross_slot_reduce([f.per_slot_reduce(), [], g.per_slot_reduce()])
    assert out[0] == 1.5 and out[1]["x"].tolist() == [1, 2] and isinstance(out[1]["x"], np.ndarray)
    assert out[2][0] == 3.0 and out[2][1] == "label"
    with pytest.raises(TypeError, match="fn must be callable"):
        FunctionReducer(None)
    with pytest.raises(TypeError, match="expects a list per slot"):
        f.cross_slot_reduce([1.0])


def test_empty_and_reset():
    for r in (Mean(), Max(), Min()):
        assert np.isnan(r.cross_slot_reduce([r.per_slot_reduce(), r.per_slot_reduce()]))
    assert Sum().cross_slot_reduce([0.0]) == 0.0
    m = Mean()
    m.update([1.0, 2.0])
    m.update(np.array([]))  # no elements: nothing
    mx = Max()
    mx.update(np.array([]))
    assert mx.per_slot_reduce() is None
    assert m.cross_slot_reduce([m.per_slot_reduce()]) == 1.5
    m.reset()
    assert m.per_slot_reduce() == (0.0, 0.0)
    mx.update([1.0, float("nan")])
    assert np.isnan(mx.cross_slot_reduce([mx.per_slot_reduce(), 5.0]))  # a nan is not hidden


def test_mean_bad_inputs_are_clear():
    m = Mean()
    with pytest.raises(TypeError, match="expected numbers"):
        m.update("0.5")
    with pytest.raises(TypeError, match=r"tuple must be \(value_sum, weight\)"):
        m.update((1.0, 2.0, 3.0))
    with pytest.raises(TypeError, match="not both"):
        m.update((1.0, 2.0), weight=3.0)
    with pytest.raises(ValueError, match="single number"):
        m.update((1.0, [2.0, 3.0]))
    with pytest.raises(ValueError, match=">= 0"):
        m.update(1.0, weight=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        m.update((1.0, -2))
    with pytest.raises(ValueError, match="does not broadcast"):
        m.update(np.zeros(3), weight=np.ones(2))
    with pytest.raises(TypeError, match="expects .sum, weight. pairs"):
        m.cross_slot_reduce([1.0])
    with pytest.raises(TypeError, match="list of per-slot states"):
        m.cross_slot_reduce(3.0)
    with pytest.raises(TypeError, match="expected"):
        Sum().update(object())
    assert m.per_slot_reduce() == (0.0, 0.0)  # nothing half-applied


def test_bfloat16_tensors_are_accepted():
    m = Mean()
    m.update(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert m.cross_slot_reduce([m.per_slot_reduce()]) == 1.5


def test_protocol_duck_typing_and_determined_style_subclass():
    class Duck:  # not a subclass: the four methods are enough
        def reset(self): ...
        def update(self, value): ...
        def per_slot_reduce(self): ...
        def cross_slot_reduce(self, per_slot_states): ...

    class NotOne:
        def update(self, value): ...

    assert isinstance(Duck(), MetricReducer) and not isinstance(NotOne(), MetricReducer)

    class Count(MetricReducer):  # Determined style: accumulate, no update
        def reset(self):
            self.n = 0

        def accumulate(self, value):
            self.n += 1

        def per_slot_reduce(self):
            return self.n

        def cross_slot_reduce(self, per_slot_states):
            return sum(per_slot_states)

    c = Count()
    c.reset()
    c.update("anything")
    c.accumulate("more")
    assert c.cross_slot_reduce([c.per_slot_reduce(), 3]) == 5

    with pytest.raises(TypeError):

        class Incomplete(MetricReducer):
            def reset(self): ...

        Incomplete()


def test_reduce_metrics_with_one_gather():
    class CountingCoordinator(LocalCoordinator):
        gathers = 0

        def all_gather(self, obj):
            CountingCoordinator.gathers += 1
            return [pickle.loads(pickle.dumps(obj))]  # what crossing processes does to the states

    reducers = {"acc": Mean(), "top": Max(), "auc": Concat(lambda s, y: roc_auc_score(y, s)), "n": Sum()}
    for b in batches(1001, 100):
        reducers["acc"].update((LABELS[b] == (SCORES[b] > 0.6)).astype(float))
        reducers["top"].update(SCORES[b])
        reducers["auc"].update((SCORES[b], LABELS[b]))
        reducers["n"].update(np.ones(len(SCORES[b])))
    coord = CountingCoordinator()
    out = reduce_metrics(reducers, coord)
    assert CountingCoordinator.gathers == 1
    assert list(out) == ["acc", "top", "auc", "n"]
    assert out["acc"] == pytest.approx(np.mean((SCORES > 0.6) == LABELS), abs=1e-12)
    assert out["top"] == SCORES.max() and out["n"] == 1001.0
    assert out["auc"] == pytest.approx(roc_auc_score(LABELS, SCORES), abs=1e-12)
    assert type(out["auc"]) is float  # numpy scalars become Python numbers
    assert reduce_metrics(reducers) == reduce_metrics(reducers, LocalCoordinator())  # default: local


def test_merge_slot_states_checks_names_and_types():
    reducers = {"a": Sum()}
    with pytest.raises(ValueError, match="different metric reducers"):
        merge_slot_states(reducers, [{"a": 1.0}, {"b": 2.0}])
    assert merge_slot_states(reducers, [{"a": 1.0}, {"a": 2.5}]) == {"a": 3.5}
    with pytest.raises(TypeError, match="reducer 'x' is not a MetricReducer"):
        slot_states({"x": lambda v: v})
    with pytest.raises(TypeError, match="dict of name -> MetricReducer"):
        reduce_metrics([Sum()])
