"""``async_save``: True, False or "auto" (:mod:`cadence.checkpoint.save_mode`), and retention beside
training after a synchronous save."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.save_mode import AUTO_COST_THRESHOLD, AUTO_SIZE_THRESHOLD, SaveMode, check_async_save
from fakes import Counter


class Slow:
    """Writes one file, taking ``seconds`` to do it: a save of a known cost."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def save_checkpoint(self, writer):
        time.sleep(self.seconds)
        writer.write("w.bin", b"w" * 100)
        return None

    def load_checkpoint(self, reader, state):
        pass

    def snapshot_checkpoint(self):  # captured at once, written later
        return Slow(self.seconds)


def test_true_and_false_decide_every_save() -> None:
    for setting in (True, False):
        mode = SaveMode(setting, state_size=lambda: 1 << 40)
        assert mode.asynchronous() is setting
        mode.record(10.0)
        assert mode.asynchronous() is setting
        mode.record(0.0)
        assert mode.asynchronous() is setting


def test_auto_follows_the_smaller_of_the_last_two_measured_costs() -> None:
    mode = SaveMode("auto", cost_threshold=0.05)
    assert mode.asynchronous() is False  # nothing measured, no estimate: synchronous
    mode.record(0.004)
    assert mode.asynchronous() is False
    mode.record(2.0)  # one slow save (an fsync stuck behind other writes) switches nothing
    assert mode.asynchronous() is False
    mode.record(0.2)
    assert mode.asynchronous() is True  # two costly saves in a row
    mode.record(0.05)
    assert mode.asynchronous() is False  # at the threshold: synchronous
    mode.record(0.06)
    assert mode.asynchronous() is False and mode.last_cost == 0.06
    assert SaveMode("auto").cost_threshold == AUTO_COST_THRESHOLD


def test_one_costly_first_save_is_enough() -> None:
    mode = SaveMode("auto", cost_threshold=0.05)
    mode.record(0.3)  # a large state measured once, no estimate given
    assert mode.asynchronous() is True


def test_auto_decides_the_first_save_by_the_estimate_called_once() -> None:
    calls = []

    def size(n: int):
        def estimate() -> int:
            calls.append(n)
            return n
        return estimate

    assert SaveMode("auto", state_size=size(10_000)).asynchronous() is False
    big = SaveMode("auto", state_size=size(AUTO_SIZE_THRESHOLD))
    assert big.asynchronous() is True and big.asynchronous() is True
    assert calls == [10_000, AUTO_SIZE_THRESHOLD]
    big.record(0.001)  # measured: the estimate no longer counts
    assert big.asynchronous() is False


def test_an_estimate_that_fails_means_a_synchronous_first_save(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> int:
        raise RuntimeError("no tensors here")

    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert SaveMode("auto", state_size=broken).asynchronous() is False
    assert "could not estimate" in caplog.text


@pytest.mark.parametrize("value", ["yes", "Auto", 1, 0, None, "true"])
def test_other_values_are_refused_naming_async_save(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match=r"^async_save must be True, False or 'auto', got "):
        check_async_save(value)
    with pytest.raises(ValueError, match="async_save"):
        CheckpointManager(str(tmp_path / "ck"), async_save=value)  # type: ignore[arg-type]


GENEROUS = 0.3  # seconds: the threshold of the tests below, far above a tiny save on a busy disk


def test_auto_saves_a_tiny_state_synchronously(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "ck"), async_save="auto", state_size=lambda: 4096)
    manager.save_mode = SaveMode("auto", state_size=lambda: 4096, cost_threshold=GENEROUS)
    for step in (1, 2, 3):
        assert manager.asynchronous(step) is False
        manager.save(step, {"c": Counter(step)})
        assert manager.take_committed() == [(step, manager.path(step))]  # committed when save returned
        assert manager.save_mode.last_cost is not None
    manager.close()


def test_auto_goes_asynchronous_after_a_costly_save_and_back(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "ck"), async_save="auto")
    manager.save_mode = SaveMode("auto", cost_threshold=GENEROUS)
    assert manager.asynchronous(1) is False
    manager.save(1, {"s": Slow(GENEROUS + 0.05)})  # measured above the threshold
    assert manager.take_committed() == [(1, manager.path(1))]
    assert manager.asynchronous(2) is True
    manager.save(2, {"s": Slow(0.1)})  # asynchronous: returns before the write, measured on the background thread
    assert manager.take_committed() == []
    manager.wait()
    assert manager.take_committed() == [(2, manager.path(2))]
    assert manager.asynchronous(3) is False  # cheap again (the smaller of the last two): synchronous
    manager.close()
    assert manager.steps() == [1, 2]


def test_a_large_estimate_makes_the_first_save_asynchronous(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "ck"), async_save="auto", state_size=lambda: AUTO_SIZE_THRESHOLD)
    assert manager.asynchronous(5) is True
    manager.save(5, {"c": Counter(5)})
    manager.close()
    assert manager.steps() == [5] and manager.take_committed() == [(5, manager.path(5))]


def test_retention_runs_beside_training_after_a_synchronous_save(tmp_path: Path) -> None:
    release = threading.Event()
    threads: list[str] = []

    def protected() -> set[int]:
        threads.append(threading.current_thread().name)
        if len(threads) == 2:  # the pass after the second save
            release.wait(2)
        return set()

    manager = CheckpointManager(str(tmp_path / "ck"), max_to_keep=1, protected_steps=protected)
    manager.save(1, {"c": Counter(1)})
    manager.save(2, {"c": Counter(2)})  # returns while its retention waits for `release`
    assert not release.is_set() and Path(manager.path(1)).exists()
    release.set()
    assert manager.steps() == [2]  # waits for the retention pass
    assert threads and all(name.startswith("cadence-retention-") for name in threads), threads
    manager.close()


def test_the_torch_estimate_counts_parameters_buffers_optimizer_state_once_each() -> None:
    import torch
    from torch import nn

    from cadence.torch.checkpoint_io.state_size import StateSizeEstimate

    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 8))
    model[2].weight = nn.Parameter(model[0].weight.t().contiguous())  # a second parameter, not tied
    tied = nn.Linear(8, 8, bias=False)
    model.append(tied)
    model.register_module("again", tied)  # the same module twice: counted once
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    estimate = StateSizeEstimate(model, optimizer)
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert estimate() == params + buffers  # no momentum yet
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    assert estimate() == 2 * params + buffers  # momentum: one buffer per parameter
