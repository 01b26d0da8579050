"""is_better: the one "is this better" comparison of the best-value actions and the sidecar."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from cadence.actions import EarlyStopping, NewBestMetric
from cadence.actions.metric_path import is_better

INF = math.inf
NAN = math.nan


@pytest.mark.parametrize(
    ("value", "reference", "higher", "expected"),
    [
        (2.0, 1.0, True, True),
        (1.0, 2.0, True, False),
        (1.0, 2.0, False, True),
        (2.0, 1.0, False, False),
        (1.0, 1.0, True, False),  # strict: a tie is no improvement
        (1.0, 1.0, False, False),
        (-0.0, 0.0, True, False),
        (3, 2, True, True),  # ints from JSON records
    ],
)
def test_strict_comparison_in_the_given_direction(value, reference, higher, expected) -> None:
    assert is_better(value, reference, higher_is_better=higher) is expected


@pytest.mark.parametrize("higher", [True, False])
def test_any_finite_value_beats_no_reference(higher: bool) -> None:
    for value in (0.0, -1e300, 1e300, 5):
        assert is_better(value, None, higher_is_better=higher)


@pytest.mark.parametrize("higher", [True, False])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("reference", [None, 0.0, NAN])
def test_a_non_finite_value_never_improves(value: float, reference: float | None, higher: bool) -> None:
    """Even -inf for a lower-is-better loss, or +inf for an accuracy: a diverged run is no best."""
    assert not is_better(value, reference, higher_is_better=higher)


@pytest.mark.parametrize("higher", [True, False])
def test_a_nan_reference_is_never_improved_on(higher: bool) -> None:
    assert not is_better(1.0, NAN, higher_is_better=higher)


def test_min_delta_needs_an_improvement_by_more_than_it() -> None:
    assert not is_better(1.5, 1.0, higher_is_better=True, min_delta=0.5)  # exactly min_delta: no
    assert is_better(1.75, 1.0, higher_is_better=True, min_delta=0.5)
    assert not is_better(0.5, 1.0, higher_is_better=False, min_delta=0.5)
    assert is_better(0.25, 1.0, higher_is_better=False, min_delta=0.5)
    assert is_better(1e-9, None, higher_is_better=True, min_delta=10.0)  # nothing to beat yet


def test_the_best_value_actions_decide_as_is_better(tmp_path: Path) -> None:
    """NewBestMetric (persisted to a real file) and EarlyStopping (min_delta 0 and not) agree with
    is_better on every pair of values, so the sidecar's report and the actions never disagree."""
    values = [-INF, -1.0, 0.0, 0.5, 1.0, INF, NAN]
    for higher, (reference, value) in itertools.product((True, False), itertools.product(values, values)):
        if not math.isfinite(reference):
            continue  # neither action ever records a non-finite reference
        best = NewBestMetric("m", higher, filename=str(tmp_path / f"best-{higher}.json"))
        assert best.commit({"m": reference})
        assert best.is_better(value) is is_better(value, reference, higher_is_better=higher)
        for min_delta in (0.0, 0.25):
            stopping = EarlyStopping("m", patience=5, min_delta=min_delta, higher_is_better=higher)
            stopping({"m": reference})
            assert stopping.improves(value) is is_better(value, reference, higher_is_better=higher,
                                                         min_delta=min_delta)
        (tmp_path / f"best-{higher}.json").unlink()
