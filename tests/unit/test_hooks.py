"""cadence.loop.hooks: callbacks told of each event in order, training start/end around a run, and
closing a run (order, once, errors)."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.extensions import Callback
from cadence.errors import PreemptedExit
from cadence.loop.hooks import CallbackHooks


RUN: Any = object()  # the run each hook is given


class Log(Callback):
    def __init__(self, events: list, name: str, fail_close: bool = False) -> None:
        self.events, self.name, self.fail_close = events, name, fail_close

    def on_train_start(self, run: Any) -> None:
        assert run is RUN
        self.events.append((self.name, "start"))

    def on_train_end(self, run: Any) -> None:
        assert run is RUN
        self.events.append((self.name, "end"))

    def on_checkpoint_save(self, run: Any, checkpoint_dir: str) -> None:
        assert run is RUN
        self.events.append((self.name, "save", checkpoint_dir))

    def on_eval_end(self, run: Any, metrics, step: int) -> None:
        assert run is RUN
        self.events.append((self.name, "eval", step))

    def on_close(self, run: Any) -> None:
        assert run is RUN
        self.events.append((self.name, "close"))
        if self.fail_close:
            raise RuntimeError(f"{self.name} cannot close")


def test_events_reach_every_callback_in_order() -> None:
    events: list = []
    hooks = CallbackHooks([Log(events, "a"), Callback(), Log(events, "b")], RUN)
    hooks.checkpoint_save("ckpt-2")
    hooks.eval_end({"x": 1}, 2)
    hooks.checkpoint_load("ckpt-2")  # nobody overrides it: the base class's no-op
    assert events == [("a", "save", "ckpt-2"), ("b", "save", "ckpt-2"), ("a", "eval", 2), ("b", "eval", 2)]


def test_only_callbacks_are_accepted() -> None:
    with pytest.raises(TypeError, match=r"callbacks\[0\]: expected a cadence.Callback .* got function"):
        CallbackHooks([lambda: None], RUN)  # type: ignore[list-item]


def test_training_ends_normally_and_on_preemption_but_not_on_errors() -> None:
    events: list = []
    hooks = CallbackHooks([Log(events, "a")], RUN)
    with hooks.training(on_preempted=lambda: events.append("waited")):
        events.append("run")
    with pytest.raises(PreemptedExit):
        with hooks.training(on_preempted=lambda: events.append("waited")):
            raise PreemptedExit(0)
    with pytest.raises(ValueError):
        with hooks.training(on_preempted=lambda: events.append("waited")):
            raise ValueError("boom")
    assert events == [("a", "start"), "run", ("a", "end"),
                      ("a", "start"), "waited", ("a", "end"),
                      ("a", "start")]


def test_close_run_runs_every_step_and_closes_callbacks_once() -> None:
    events: list = []
    hooks = CallbackHooks([Log(events, "a", fail_close=True), Log(events, "b")], RUN)
    with pytest.raises(RuntimeError, match="a cannot close"):  # raised after every callback closed
        hooks.close_run(lambda: events.append("first"), lambda: events.append("second"), propagating=False)
    assert events == ["first", "second", ("a", "close"), ("b", "close")]
    hooks.close_run(lambda: events.append("again"), propagating=False)  # callbacks close once
    assert events[-1] == "again" and events.count(("a", "close")) == 1


def test_close_run_failure_propagates_after_the_other_steps_and_callbacks() -> None:
    events: list = []
    hooks = CallbackHooks([Log(events, "a", fail_close=True)], RUN)

    def first() -> None:
        raise OSError("pending save failed")

    with pytest.raises(OSError, match="pending save failed"):  # not masked by on_close's error
        hooks.close_run(first, lambda: events.append("summaries"), propagating=False)
    assert events == ["summaries", ("a", "close")]


def test_close_run_while_propagating_logs_on_close_errors() -> None:
    events: list = []
    hooks = CallbackHooks([Log(events, "a", fail_close=True)], RUN)
    hooks.close_run(lambda: None, propagating=True)  # an exception is on its way out: not replaced
    assert events == [("a", "close")]


class Step(Callback):
    def __init__(self, events: list, name: str) -> None:
        self.events, self.name = events, name

    def on_train_step_end(self, run: Any, step: int) -> None:
        self.events.append((self.name, step, run))


def test_step_end_calls_the_overriding_callbacks_in_order_and_is_none_without_them() -> None:
    assert CallbackHooks([Callback(), Log([], "a")], RUN).step_end() is None  # nothing to call per step
    events: list = []
    only = CallbackHooks([Log([], "a"), Step(events, "x")], RUN).step_end()
    assert only is not None
    only(1)
    both = CallbackHooks([Step(events, "y"), Callback(), Step(events, "z")], RUN).step_end()
    assert both is not None
    both(2)
    assert events == [("x", 1, RUN), ("y", 2, RUN), ("z", 2, RUN)]
