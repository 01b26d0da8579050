"""cadence.extensions: the declared protocols and the walk over wrapped actions."""

from __future__ import annotations

from cadence.actions import ConditionalAction, NewBestMetric, PeriodicAction
from cadence.extensions import Stateful
from cadence.extensions import Closeable, Composite, RunAware
from cadence.loop.members import components, owner_of, stateful_members


class Aware:
    def attach(self, run) -> None: ...

    def __call__(self, output) -> None: ...


class Closing:
    def close(self) -> None: ...

    def __call__(self, output) -> None: ...


def plain(output) -> None: ...


def test_protocols_are_declared_by_methods() -> None:
    assert isinstance(Aware(), RunAware) and not isinstance(Aware(), Closeable)
    assert isinstance(Closing(), Closeable) and not isinstance(Closing(), RunAware)
    assert not isinstance(plain, (RunAware, Closeable, Composite, Stateful))
    assert isinstance(ConditionalAction(plain, plain), Composite)
    assert isinstance(NewBestMetric("acc"), Stateful)


def test_owner_of_a_bound_method_is_its_instance() -> None:
    best = NewBestMetric("acc")
    assert owner_of(best.test) is best
    assert owner_of(plain) is plain


def test_components_walk_wrappers_depth_first_once_each() -> None:
    best, aware, closing = NewBestMetric("acc"), Aware(), Closing()
    inner = ConditionalAction(best.test, [aware, best.commit])
    outer = PeriodicAction([inner, closing], every_n_steps=2)
    found = components([outer, aware, plain])
    assert found == [outer, inner, best, aware, closing, plain]  # aware listed once


def test_stateful_members_are_named_by_group_position_and_class() -> None:
    class Named(NewBestMetric):
        checkpoint_name = "custom"

    found = stateful_members(train_actions=[plain, NewBestMetric("acc")], callbacks=[Named("x")])
    assert list(found) == ["train_actions/1/NewBestMetric", "callbacks/0/custom"]
