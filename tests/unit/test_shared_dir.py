"""The check that every rank sees the chief's model dir (cadence.checkpoint.shared_dir), with each
"rank" a thread and each one's view of the model dir a ``memory://`` path: the same path is a shared
model dir, another path a node-local disk; and how a rank's bad input reaches ``cadence train``'s
one line through torchrun's error file (cadence.cli.torchrun)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

import pytest

from cadence.checkpoint.shared_dir import check_shared, place
from cadence.checkpoint.writer_lease import WriterLease, read_lease
from cadence.errors import ModelDirNotSharedError
from cadence.runtime.coordination import LocalCoordinator
from cadence.storage import Storage

NOT_SHARED = "every node must mount the same storage at that path (a shared file system or an object store URL)"


class Threads:
    """A coordinator over threads: every collective waits for all ranks (a rank that skips one
    breaks the barrier of the others instead of letting them pass)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=20)
        self.slots: list[Any] = [None] * world_size
        self.calls: list[str] = []

    def rank(self, rank: int) -> Any:
        group = self

        class Rank:
            world_size = group.world_size
            is_chief = rank == 0

            def __init__(self) -> None:
                self.rank = rank

            def _exchange(self, what: str, obj: Any) -> list[Any]:
                if rank == 0:
                    group.calls.append(what)
                group.slots[rank] = obj
                group.barrier.wait()
                gathered = list(group.slots)
                group.barrier.wait()
                return gathered

            def broadcast(self, obj: Any, src: int = 0) -> Any:
                return self._exchange("broadcast", obj)[src]

            def all_gather(self, obj: Any) -> list[Any]:
                return self._exchange("all_gather", obj)

        return Rank()


def run_ranks(world_size: int, body: Callable[[Any], Any]) -> tuple[list[Any], list[str]]:
    """``body(coordinator)`` on each rank's thread: each rank's result or exception, and the
    collectives called."""
    group = Threads(world_size)
    outcomes: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = body(group.rank(rank))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcomes[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes, group.calls


@pytest.fixture
def dirs() -> Callable[[str], str]:
    base = f"memory://shared-dir-{uuid.uuid4().hex[:8]}"
    return lambda name: f"{base}/{name}/run"


def views(lease_dir: str, others: dict[int, str]) -> Callable[[Any], Any]:
    """Each rank's body: the chief acquires the writer lease of ``lease_dir`` and checks; rank r
    checks through ``others.get(r, lease_dir)`` (its view of the same path)."""

    def body(coord: Any) -> Any:
        if coord.is_chief:
            with WriterLease.acquire(lease_dir, ttl=30) as lease:
                return check_shared(lease_dir, coord, lease.record, wait_s=0.2)
        return check_shared(others.get(coord.rank, lease_dir), coord, None, wait_s=0.2)

    return body


def test_ranks_that_see_the_chiefs_model_dir_pass(dirs):
    outcomes, calls = run_ranks(3, views(dirs("shared"), {}))
    assert outcomes == [None, None, None]
    assert calls == ["broadcast", "all_gather"]


def test_a_rank_with_a_node_local_model_dir_fails_every_rank_with_one_line(dirs):
    started = time.monotonic()
    outcomes, _ = run_ranks(4, views(dirs("shared"), {2: dirs("node1"), 3: dirs("node1")}))
    assert time.monotonic() - started < 5
    assert all(isinstance(o, ModelDirNotSharedError) and o.exit_code == 2 for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1  # every rank raises the same error
    here = place()
    assert str(outcomes[0]) == (
        f"model dir {dirs('shared')} is not shared: rank 0 ({here}) wrote .writer/lease-000000000001.json there, "
        f"and ranks 2, 3 ({here}) do not see it; {NOT_SHARED}")
    assert not Storage(dirs("node1")).exists(Storage(dirs("node1")).root)  # nothing was written there


def test_a_rank_that_finds_another_runs_lease_by_that_name_fails(dirs):
    local = dirs("node1")
    WriterLease.acquire(local, ttl=30).release()  # a node-local dir with a run of its own: the same token
    mine = read_lease(local, 1)
    outcomes, _ = run_ranks(2, views(dirs("shared"), {1: local}))
    assert all(isinstance(o, ModelDirNotSharedError) for o in outcomes), outcomes
    assert (f"and rank 1 ({place()}) finds another file by that name (a lease of pid {mine.pid} on host "
            f"{mine.host}); {NOT_SHARED}") in str(outcomes[1])


def test_a_file_that_shows_up_late_on_a_rank_is_waited_for(dirs):
    # a shared file system that shows a new file to another machine after a moment
    shared, late = dirs("shared"), dirs("late")

    def body(coord: Any) -> Any:
        if coord.is_chief:
            with WriterLease.acquire(shared, ttl=30) as lease:
                src = Storage(shared)
                data = src.read_bytes(src.join(".writer", "lease-000000000001.json"))

                def copy() -> None:
                    dst = Storage(late)
                    dst.makedirs(dst.join(".writer"))
                    dst.write_bytes(dst.join(".writer", "lease-000000000001.json"), data)

                threading.Timer(0.3, copy).start()
                return check_shared(shared, coord, lease.record, wait_s=2.0)
        return check_shared(late, coord, None, wait_s=2.0)

    outcomes, _ = run_ranks(2, body)
    assert outcomes == [None, None]


def test_one_process_or_no_lease_checks_nothing(dirs):
    check_shared(dirs("nowhere"), LocalCoordinator(), None)  # no collective, no read
    outcomes, calls = run_ranks(2, lambda coord: check_shared(dirs("nowhere"), coord, None))
    assert outcomes == [None, None] and calls == ["broadcast"]  # the chief holds no lease: nothing to check


# -- a rank's bad input, printed once by cadence train ---------------------------------------------


def test_a_ranks_bad_input_reaches_the_launcher_through_torchruns_error_file(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from cadence.cli.torchrun import ERRORS_ENV, _read_report, bad_input, failure_message
    from cadence.cli.torchrun_agent import write_report as _write_report
    from cadence.cli.torchrun import record_for_launcher

    error_file = tmp_path / "error.json"
    monkeypatch.delenv(ERRORS_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert record_for_launcher("model dir /x is not shared: ...") is False  # under plain torchrun: printed too
    monkeypatch.setenv(ERRORS_ENV, "1")
    assert record_for_launcher("model dir /x is not shared: ...") is True  # under cadence train --nproc
    failures = {0: ProcessFailure(local_rank=0, pid=11, exitcode=2, error_file=str(error_file)),
                1: ProcessFailure(local_rank=1, pid=12, exitcode=-15, error_file="<N/A>")}
    report = tmp_path / "report.json"
    _write_report(str(report), ChildFailedError("cadence", failures))
    recorded = _read_report(str(report))
    assert recorded[0]["message"] == "model dir /x is not shared: ..." and "message" not in recorded[1]
    assert bad_input(recorded) == "model dir /x is not shared: ..."  # the others were stopped by the launcher
    mixed = [*recorded, {"rank": 2, "local_rank": 0, "pid": 13, "exitcode": 1}]
    assert bad_input(mixed) is None  # another rank failed on its own: the job failed (exit 1)
    assert failure_message(1, mixed, 0).startswith(
        "rank 0 (local rank 0, pid 11) exited with status 2 (model dir /x is not shared: ...); also ended:")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert record_for_launcher("x") is False  # not a rank of a torchrun job
