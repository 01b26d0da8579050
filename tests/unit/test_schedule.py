"""cadence.loop.schedule: interval crossings, evaluation segments, the loop's evaluation state and
tf.estimator's throttling (with a fake clock)."""

from __future__ import annotations

import pytest

from cadence.loop.schedule import (
    EvalState,
    EvalThrottle,
    check_advance,
    check_interval,
    check_loop_settings,
    crossed,
    segment_target,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_crossed_counts_multiples_in_the_half_open_range() -> None:
    assert crossed(3, 6, 5)  # 5 in (3, 6]
    assert crossed(4, 5, 5)  # landing counts
    assert not crossed(5, 9, 5)  # 5 is not in (5, 9]
    assert not crossed(0, 100, None)
    assert crossed(9, 21, 5)  # several multiples: once


def test_segment_target_cuts_at_absolute_multiples() -> None:
    assert segment_target(0, 10, 6) == 6
    assert segment_target(6, 10, 6) == 10  # capped at train_steps
    assert segment_target(7, None, 5) == 10  # a resumed run lands on the same boundaries
    assert segment_target(3, 10, None) == 10
    assert segment_target(3, None, None) is None


def test_check_interval_and_loop_settings() -> None:
    check_interval("x", None)
    check_interval("x", 3)
    for bad in (0, -1, True, 2.5, "3"):
        with pytest.raises(ValueError, match=r"x must be an int >= 1 or None"):
            check_interval("x", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps_per_loop is required"):
        check_loop_settings(None, None, None, training=True)
    check_loop_settings(None, None, None, training=False)
    check_loop_settings(lambda step: 3, 10, 7, training=True)  # a callable is checked per loop
    with pytest.raises(ValueError, match=r"summary_interval \(7\) must be a multiple of steps_per_loop \(2\)"):
        check_loop_settings(2, None, 7, training=True)


def test_check_advance() -> None:
    assert check_advance(0, 5, 5, until_exhausted=False) is False
    assert check_advance(0, 3, 5, until_exhausted=True) is True  # the data ran out
    with pytest.raises(RuntimeError, match="advanced the global step by 3 .* 5 steps were requested; "
                                           "the training data may be exhausted"):
        check_advance(0, 3, 5, until_exhausted=False)
    with pytest.raises(RuntimeError, match="by 6 .*5 steps were requested$"):
        check_advance(0, 6, 5, until_exhausted=True)


def test_eval_state_due_on_resume_and_round_trip() -> None:
    state = EvalState()
    assert state.due_on_resume(10, 5)  # preempted before the evaluation at 10
    assert not state.due_on_resume(10, None)
    assert not state.due_on_resume(0, 5)
    assert not state.due_on_resume(12, 5)
    state.last_eval_step = 10
    assert not state.due_on_resume(10, 5)
    restored = EvalState()
    restored.load_state_dict(state.state_dict())
    assert restored.last_eval_step == 10


def test_throttle_start_delay_and_spacing() -> None:
    clock = FakeClock()
    throttle = EvalThrottle(throttle_secs=10, start_delay_secs=5, clock=clock)
    assert throttle.skips()  # inside the start delay
    clock.now += 5
    assert not throttle.skips()
    throttle.evaluating()
    clock.now += 9.9
    assert throttle.skips()  # less than throttle_secs after the previous one started
    clock.now += 0.1
    assert not throttle.skips()
    assert not EvalThrottle(clock=clock).skips()
    with pytest.raises(ValueError, match="must be >= 0"):
        EvalThrottle(throttle_secs=-1)
