"""ProgressReporter: plain lines off a terminal (rate-limited), a rich bar on one."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from cadence.loop.hooks import CallbackHooks
from cadence.loop.reports import LoopReports
from cadence.summaries import progress
from cadence.summaries.progress import ProgressReporter, format_duration, format_logs, format_rate
from cadence.summaries.throughput import LoopWork, format_throughput


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress, "_monotonic", fake)
    return fake


def plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=80), buf


def lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_plain_lines(clock: FakeClock) -> None:
    console, buf = plain_console()
    with ProgressReporter(600, console=console, log_interval_s=0) as p:
        for step in (100, 200):
            clock.now += 10
            p.update(step, {"loss": 0.123456, "lr": 3e-4})
    out = lines(buf)
    assert out[0] == "step 100/600 (17%)  10.0 steps/s  eta 0:00:50  loss=0.1235  lr=0.0003"
    assert out[1] == "step 200/600 (33%)  10.0 steps/s  eta 0:00:40  loss=0.1235  lr=0.0003"
    # the closing line: overall rate and elapsed time
    assert out[2] == "step 200/600 (33%)  10.0 steps/s  elapsed 0:00:20  loss=0.1235  lr=0.0003"
    assert len(out) == 3


def test_rate_limited(clock: FakeClock) -> None:
    console, buf = plain_console()
    p = ProgressReporter(1000, console=console, log_interval_s=30)
    for step in range(10, 110, 10):  # 10 updates, 10 s apart
        clock.now += 10
        p.update(step)
    assert [line.split()[1] for line in lines(buf)] == ["30/1000", "60/1000", "90/1000"]
    p.close()
    assert lines(buf)[-1].startswith("step 100/1000 (10%)")


def test_large_interval_prints_only_at_close(clock: FakeClock) -> None:
    console, buf = plain_console()
    with ProgressReporter(100, console=console, log_interval_s=1e9) as p:
        for step in range(1, 101):
            clock.now += 0.5
            p.update(step, {"loss": 1.0 / step})
    (line,) = lines(buf)
    assert line == "step 100/100 (100%)  2.0 steps/s  elapsed 0:00:50  loss=0.01"


def test_logs_persist_until_replaced(clock: FakeClock) -> None:
    console, buf = plain_console()
    p = ProgressReporter(None, console=console, log_interval_s=0)
    clock.now += 1
    p.update(1, {"loss": 2.0})
    clock.now += 1
    p.update(2)
    assert lines(buf)[-1].endswith("loss=2")


def test_no_total_no_eta(clock: FakeClock) -> None:
    console, buf = plain_console()
    with ProgressReporter(None, console=console, log_interval_s=0) as p:
        clock.now += 4
        p.update(8, {"loss": 0.5})
    first, last = lines(buf)
    assert first == "step 8  2.0 steps/s  loss=0.5"
    assert "%" not in last and "eta" not in last


def test_initial_step_and_slow_rate(clock: FakeClock) -> None:
    console, buf = plain_console()
    p = ProgressReporter(1000, initial_step=500, console=console, log_interval_s=0)
    clock.now += 40
    p.update(510)
    assert lines(buf)[0] == "step 510/1000 (51%)  4.0 s/step  eta 0:32:40"


def test_rollback_restarts_rate(clock: FakeClock) -> None:
    console, buf = plain_console()
    p = ProgressReporter(100, console=console, log_interval_s=0)
    clock.now += 1
    p.update(50)
    clock.now += 1
    p.update(40)  # rolled back: no rate can be known yet
    assert lines(buf)[-1] == "step 40/100 (40%)"
    clock.now += 1
    p.update(45)
    assert lines(buf)[-1] == "step 45/100 (45%)  5.0 steps/s  eta 0:00:11"


def test_message_is_a_plain_line(clock: FakeClock) -> None:
    console, buf = plain_console()
    with ProgressReporter(10, console=console, log_interval_s=1e9) as p:
        p.message("[bold]saved[/bold] checkpoint ckpt-10 " + "x" * 100)
    assert (
        lines(buf)[0] == "[bold]saved[/bold] checkpoint ckpt-10 " + "x" * 100
    )  # no markup, no wrap


def test_disabled_is_silent(clock: FakeClock) -> None:
    console, buf = plain_console()
    with ProgressReporter(10, console=console, enabled=False, log_interval_s=0) as p:
        p.update(5, {"loss": 1.0})
        p.message("hi")
    assert buf.getvalue() == ""


def test_enabled_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    console, _ = plain_console()
    monkeypatch.setenv("RANK", "1")
    assert not ProgressReporter(10, console=console).enabled
    monkeypatch.setenv("RANK", "0")
    assert ProgressReporter(10, console=console).enabled
    monkeypatch.delenv("RANK")
    assert ProgressReporter(10, console=console).enabled


def test_update_after_close_is_ignored(clock: FakeClock) -> None:
    console, buf = plain_console()
    p = ProgressReporter(10, console=console, log_interval_s=0)
    p.close()
    before = buf.getvalue()
    p.update(5)
    p.close()
    assert buf.getvalue() == before


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0:00:00"),
        (32.4, "0:00:32"),
        (59.6, "0:01:00"),
        (3661, "1:01:01"),
        (90061, "25:01:01"),
        (None, "?"),
        (float("inf"), "?"),
        (float("nan"), "?"),
        (-5, "0:00:00"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_rate_and_logs() -> None:
    assert format_rate(12.34) == "12.3 steps/s"
    assert format_rate(0.25) == "4.0 s/step"
    assert format_rate(None) == "" and format_rate(0) == ""
    assert format_logs({"loss": 0.123456, "n": 3, "eval": {"acc": 0.5}, "name": "x"}) == (
        "loss=0.1235  n=3  eval/acc=0.5"
    )
    assert format_logs({"loss": float("nan")}) == "loss=nan"


def test_terminal_mode_renders_bar() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    with ProgressReporter(600, console=console) as p:
        p.update(100, {"loss": 0.5})
        p.message("checkpoint saved")
        p.update(600, {"loss": 0.25})
    out = buf.getvalue()
    assert "600/600" in out
    assert "checkpoint saved" in out
    assert "loss=0.25" in out


def test_terminal_mode_without_total() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    with ProgressReporter(None, console=console) as p:
        p.update(10, {"loss": 1.0})
        p.update(5)  # a rollback does not crash the bar
        p.update(20)
    assert "20/?" in buf.getvalue()


class EightSamplesAStep:
    """A trainer that says what its last loop processed (CountsWork): 8 samples a step."""

    steps = 0

    def loop_work(self) -> LoopWork:
        return LoopWork(samples=8 * self.steps)


def number(text: str) -> float:
    return float(text[:-1]) * 1000 if text.endswith("k") else float(text)


@pytest.mark.parametrize("terminal", [False, True])
def test_every_rate_on_the_line_is_the_last_loops(clock: FakeClock, terminal: bool) -> None:
    # loops of 10 steps in 0.8 s each, 3 s apart (evaluations and checkpoints between them): the line's
    # steps/s is the loop's, as its samples/s is, so steps/s x 8 samples per step == samples/s
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=200, color_system=None)
    reports = LoopReports(None, None, chief=True, summary_interval=None, hooks=CallbackHooks([], run=None))  # type: ignore[arg-type]
    trainer = EightSamplesAStep()
    with ProgressReporter(100, console=console, log_interval_s=0) as p:
        for after in (10, 20):
            trainer.steps = 10
            clock.now += 3.0
            reports.after_loop(trainer, after - 10, after, {"loss": 1.0}, 0.8, p)
    shown = [line for line in buf.getvalue().splitlines() if "samples/s" in line]
    assert shown
    for line in shown:
        steps = float(re.search(r"([\d.]+) steps/s", line)[1])  # type: ignore[index]
        samples = number(re.search(r"([\d.]+k?) samples/s", line)[1])  # type: ignore[index]
        assert (steps, samples) == (12.5, 100.0) and steps * 8 == samples
    if not terminal:
        assert shown[0] == "step 10/100 (10%)  12.5 steps/s  eta 0:00:07  100 samples/s  loss=1"
        assert shown[-1] == "step 20/100 (20%)  12.5 steps/s  elapsed 0:00:06  100 samples/s  loss=1"


def test_throughput_to_three_significant_digits() -> None:
    assert format_throughput({"mfu": 0.00013}) == "MFU 0.013%"
    assert format_throughput({"mfu": 0.000134567}) == "MFU 0.0135%"
    assert format_throughput({"mfu": 0.41234, "samples_per_second": 1574.0}) == "1.57k samples/s  MFU 41.2%"
