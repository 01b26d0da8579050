"""Tests of cadence.checkpoint.leases, lease_file and lease_keeper: range leases, the keeper thread, retention honouring them."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.lease_file import Lease
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.checkpoint.leases import Leases
from cadence.storage import Storage
from fakes import Counter

HERE = Path(__file__).resolve().parents[1]
SRC = HERE.parent / "src"
T0 = 1_700_000_000.0


def save(manager: CheckpointManager, *steps: int) -> list[int]:
    for step in steps:
        manager.save(step, {"counter": Counter(step)})
    return manager.steps()


@pytest.fixture
def ckdir(tmp_path: Path) -> str:
    return str(tmp_path / "model" / "checkpoints")


def lease(after=None, reading=None, expires=T0 + 10, max_pending=None) -> Lease:
    return Lease("eval", after=after, reading=reading, expires=expires, pid=1, host="h", time=T0,
                 max_pending=max_pending)


def wait_for(condition, timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- Lease ---------------------------------------------------------------------------------------


def test_protects_reading_and_range() -> None:
    steps = [0, 10, 20, 30, 40]
    assert lease().protects(steps) == set()
    assert lease(reading=20).protects(steps) == {20}
    assert lease(reading=25).protects(steps) == set()  # only steps among those given
    assert lease(after=20).protects(steps) == {30, 40}
    assert lease(after=20, reading=10).protects(steps) == {10, 30, 40}
    assert lease(after=0).protects(steps) == {10, 20, 30, 40}
    assert lease(after=-1).protects(steps) == {0, 10, 20, 30, 40}  # a reader that has seen nothing yet


def test_max_pending_bounds_the_range_to_its_newest_steps() -> None:
    steps = [40, 0, 10, 30, 20]
    assert lease(after=0, max_pending=2).protects(steps) == {30, 40}
    assert lease(after=0, max_pending=2, reading=10).protects(steps) == {10, 30, 40}
    assert lease(after=30, max_pending=5).protects(steps) == {40}
    assert lease(after=None, max_pending=1, reading=0).protects(steps) == {0}  # no range to bound


def test_expired_by_the_given_clock() -> None:
    assert not lease(expires=T0 + 10).expired(T0 + 9.99)
    assert lease(expires=T0 + 10).expired(T0 + 10)


# -- Leases: reading and writing -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_write_read_active_release(where: str, ckdir: str, memdir: str) -> None:
    directory = ckdir if where == "local" else memdir
    leases = Leases(directory)
    assert leases.read_all() == [] and leases.active() == []  # no .leases/ yet: no leases

    before = time.time()
    written = leases.write("eval", after=10, reading=None, ttl=30.0)
    assert written.holder == "eval" and written.after == 10 and written.reading is None
    assert written.pid == os.getpid() and written.host and before <= written.time <= time.time()
    assert written.expires == pytest.approx(written.time + 30.0)
    leases.write("eval-b_1.x", after=None, reading=5, ttl=1.0)

    assert leases.read_all()[0] == written
    assert [le.holder for le in leases.read_all()] == ["eval", "eval-b_1.x"]
    assert [le.holder for le in leases.active(now=written.time + 10)] == ["eval"]
    assert leases.active(now=written.time + 40) == []
    assert leases.protected_steps([5, 10, 20], now=written.time) == {5, 20}
    assert leases.protected_steps([5, 10, 20], now=written.time + 10) == {20}
    assert leases.protected_steps([5, 10, 20], now=written.time + 40) == set()

    replaced = leases.write("eval", after=20, reading=20, ttl=30.0)  # replaces, never appends
    assert [le for le in leases.read_all() if le.holder == "eval"] == [replaced]

    leases.release("eval")
    leases.release("eval")  # absent: no error
    assert [le.holder for le in leases.read_all()] == ["eval-b_1.x"]
    storage = Storage(directory)
    assert storage.listdir(storage.join(".leases")) == ["eval-b_1.x.json"]


def test_file_format_and_atomic_write(ckdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    leases = Leases(ckdir)
    for i in range(5):
        leases.write("eval", after=i, reading=i + 1, ttl=60.0)
    assert os.listdir(Path(ckdir, ".leases")) == ["eval.json"]  # no temp leftovers
    document = json.loads(Path(ckdir, ".leases", "eval.json").read_bytes())
    assert set(document) == {"holder", "after", "reading", "max_pending", "expires", "pid", "host", "time"}
    assert document["max_pending"] is None
    assert document["holder"] == "eval" and document["after"] == 4 and document["reading"] == 5

    # the write goes through Storage.write_atomic (temp + rename): a failure leaves the old lease
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        leases.write("eval", after=99, reading=None, ttl=60.0)
    monkeypatch.undo()
    assert os.listdir(Path(ckdir, ".leases")) == ["eval.json"]
    assert leases.read_all()[0].after == 4


@pytest.mark.parametrize("holder", ["", "a/b", "../x", "a b", "é", "x\n", None, 3])
def test_holder_names_are_validated(ckdir: str, holder) -> None:
    leases = Leases(ckdir)
    with pytest.raises(ValueError, match="holder"):
        leases.write(holder, after=None, reading=None, ttl=1.0)
    with pytest.raises(ValueError, match="holder"):
        leases.release(holder)
    with pytest.raises(ValueError, match="holder"):
        LeaseKeeper(leases, holder)
    assert not Path(ckdir).exists()


def test_bad_steps_and_ttl_are_refused(ckdir: str) -> None:
    leases = Leases(ckdir)
    bad = ({"after": -2}, {"reading": -1}, {"reading": 1.5}, {"reading": True}, {"max_pending": 0},
           {"max_pending": 2.0}, {"ttl": 0}, {"ttl": float("inf")})
    for kwargs in bad:
        arguments = {"after": None, "reading": None, "ttl": 1.0, **kwargs}
        with pytest.raises(ValueError):
            leases.write("eval", **arguments)
    with pytest.raises(ValueError, match="renew_every"):
        LeaseKeeper(leases, "eval", ttl=1.0, renew_every=1.0)
    with pytest.raises(ValueError, match="max_pending"):
        LeaseKeeper(leases, "eval", max_pending=0)
    assert not Path(ckdir).exists()


def test_garbage_files_are_skipped_with_a_warning(ckdir: str, caplog: pytest.LogCaptureFixture) -> None:
    leases = Leases(ckdir)
    good = leases.write("good", after=None, reading=7, ttl=60.0)
    root = Path(ckdir, ".leases")
    (root / "torn.json").write_bytes(b'{"holder": "torn", "after": 1')
    (root / "list.json").write_bytes(b"[1, 2]")
    (root / "noexp.json").write_bytes(b'{"after": 1, "reading": null}')
    (root / "nan.json").write_bytes(b'{"after": 1, "reading": null, "expires": NaN}')
    (root / "badstep.json").write_bytes(json.dumps({"after": "x", "reading": None, "expires": 1e12}).encode())
    (root / "badmax.json").write_bytes(json.dumps({"after": 1, "reading": None, "expires": 1e12, "max_pending": -3}).encode())
    (root / "binary.json").write_bytes(b"\xff\xfe")
    (root / "dir.json").mkdir()  # unreadable
    (root / "good.json.tmp-0123abcd").write_bytes(b"{")  # a write in flight: ignored silently
    (root / "notes.txt").write_text("not a lease")

    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert leases.read_all() == [good]
        assert leases.protected_steps([6, 7, 8]) == {7}
    for name in ("torn", "list", "noexp", "nan", "badstep", "badmax", "binary", "dir"):
        assert f"{name}.json" in caplog.text
    assert "tmp-0123abcd" not in caplog.text and "notes.txt" not in caplog.text


def test_lenient_about_informational_fields(ckdir: str) -> None:
    root = Path(ckdir, ".leases")
    root.mkdir(parents=True)
    (root / "mine.json").write_bytes(json.dumps({"holder": "other", "after": 3, "reading": None, "expires": 1e12}).encode())
    [found] = Leases(ckdir).read_all()
    assert found == Lease("mine", after=3, reading=None, expires=1e12, pid=0, host="", time=0.0, max_pending=None)


def test_remove_expired(ckdir: str) -> None:
    leases = Leases(ckdir)
    now = time.time()
    leases.write("alive", after=1, reading=None, ttl=100.0)
    leases.write("dead", after=1, reading=None, ttl=1.0)
    root = Path(ckdir, ".leases")
    old = now - 7200
    (root / "torn.json").write_bytes(b"{")
    os.utime(root / "torn.json", (old, old))
    (root / "fresh-torn.json").write_bytes(b"{")  # maybe a write in flight on a non-atomic store
    (root / "dead.json.tmp-00aa11").write_bytes(b"{")
    os.utime(root / "dead.json.tmp-00aa11", (old, old))
    (root / "alive.json.tmp-00bb22").write_bytes(b"{")  # young: may be in flight
    (root / "notes.txt").write_text("not ours")
    os.utime(root / "notes.txt", (old, old))

    assert leases.remove_expired(grace=10.0, now=now + 5) == ["dead.json.tmp-00aa11", "torn.json"]
    assert leases.remove_expired(grace=10.0, now=now + 12) == ["dead.json"]
    assert sorted(os.listdir(root)) == ["alive.json", "alive.json.tmp-00bb22", "fresh-torn.json", "notes.txt"]
    assert leases.remove_expired(now=now + 50) == []  # unexpired leases are never touched
    assert Leases(ckdir + "-none").remove_expired() == []


def test_writer_start_up_removes_long_dead_leases_only(ckdir: str) -> None:
    leases = Leases(ckdir)
    leases.write("alive", after=1, reading=None, ttl=60.0)
    leases.write("recent", after=1, reading=None, ttl=1.0)
    root = Path(ckdir, ".leases")
    document = json.loads((root / "recent.json").read_bytes())
    document["expires"] = time.time() - 7200
    (root / "ancient.json").write_bytes(json.dumps(document).encode())
    document["expires"] = time.time() - 60
    (root / "recent.json").write_bytes(json.dumps(document).encode())

    CheckpointManager(ckdir, writer=False)
    assert len(os.listdir(root)) == 3  # readers change nothing
    CheckpointManager(ckdir)
    assert sorted(os.listdir(root)) == ["alive.json", "recent.json"]


# -- retention honours leases --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_range_lease_protects_later_checkpoints_until_released(where: str, ckdir: str, memdir: str) -> None:
    directory = ckdir if where == "local" else memdir
    manager = CheckpointManager(directory, max_to_keep=2)
    assert save(manager, 10) == [10]
    leases = Leases(directory)
    leases.write("eval", after=10, reading=None, ttl=60.0)

    assert save(manager, 20, 30, 40) == [20, 30, 40]  # 10 is not protected: pruned
    assert save(manager, 50, 60) == [20, 30, 40, 50, 60]  # committed after the reader looked: protected too

    leases.write("eval", after=40, reading=None, ttl=60.0)  # the reader moved on
    assert save(manager, 70) == [50, 60, 70]
    leases.release("eval")
    assert save(manager, 80) == [70, 80]
    assert Storage(directory).listdir(Storage(directory).join(".leases")) == ["deleted-steps"]  # no lease left


def test_expired_lease_protects_nothing(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1)
    leases = Leases(ckdir)
    leases.write("dead", after=0, reading=10, ttl=60.0)
    path = Path(ckdir, ".leases", "dead.json")
    document = json.loads(path.read_bytes())
    document["expires"] = time.time() - 1
    path.write_bytes(json.dumps(document).encode())
    assert save(manager, 10, 20, 30) == [30]
    assert path.exists()  # only start-up clean-up (after a long grace) removes it


def test_bounded_range_and_a_reader_that_has_seen_nothing(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1)
    leases = Leases(ckdir)
    leases.write("eval", after=-1, reading=None, ttl=60.0)  # nothing evaluated yet: protect all
    assert save(manager, 0, 10, 20) == [0, 10, 20]
    leases.write("eval", after=-1, reading=None, ttl=60.0, max_pending=2)  # fell behind: bound it
    assert save(manager, 30) == [20, 30]
    leases.write("eval", after=20, reading=20, ttl=60.0, max_pending=2)
    assert save(manager, 40, 50, 60) == [20, 50, 60]


def test_reading_alone_protects_that_step(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1)
    save(manager, 10, 20)
    Leases(ckdir).write("latest-eval", after=None, reading=20, ttl=60.0)
    assert save(manager, 30, 40, 50) == [20, 50]
    Leases(ckdir).write("latest-eval", after=None, reading=50, ttl=60.0)
    assert save(manager, 60) == [50, 60]


def test_leases_combine_with_protected_steps(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1, protected_steps=lambda: {10})
    Leases(ckdir).write("eval", after=None, reading=20, ttl=60.0)
    assert save(manager, 10, 20, 30, 40) == [10, 20, 40]


def test_unlistable_leases_skip_retention(ckdir: str, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1)
    save(manager, 10)

    def broken(self):
        raise OSError("lease dir unreadable")

    monkeypatch.setattr(Leases, "read_all", broken)
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert save(manager, 20) == [10, 20]
    assert "leases" in caplog.text and "skipping retention" in caplog.text
    monkeypatch.undo()
    assert save(manager, 30) == [30]


# -- LeaseKeeper ---------------------------------------------------------------------------------


def read_lease(leases: Leases, holder: str) -> Lease | None:
    return next((le for le in leases.read_all() if le.holder == holder), None)


def test_keeper_renews_updates_and_releases(ckdir: str) -> None:
    leases = Leases(ckdir)
    keeper = LeaseKeeper(leases, "eval", ttl=0.5, renew_every=0.05, after=3)
    assert read_lease(leases, "eval") is None  # nothing before start()
    assert keeper.start() is keeper
    first = read_lease(leases, "eval")
    assert first is not None and first.after == 3 and first.reading is None and first == keeper.lease

    wait_for(lambda: read_lease(leases, "eval").expires > first.expires, what="a renewal")

    keeper.update(reading=7)
    on_disk = read_lease(leases, "eval")
    assert (on_disk.after, on_disk.reading) == (3, 7)  # visible as soon as update() returns
    keeper.update(after=None)
    on_disk = read_lease(leases, "eval")
    assert (on_disk.after, on_disk.reading) == (None, 7)  # None set explicitly, reading unchanged
    keeper.update(after=9, reading=None)
    assert (read_lease(leases, "eval").after, read_lease(leases, "eval").reading) == (9, None)
    keeper.update(max_pending=3)
    assert (read_lease(leases, "eval").after, read_lease(leases, "eval").max_pending) == (9, 3)
    with pytest.raises(ValueError):
        keeper.update(reading=-2)

    thread = keeper._thread
    keeper.close()
    assert not thread.is_alive() and read_lease(leases, "eval") is None
    keeper.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        keeper.update(reading=1)
    with pytest.raises(RuntimeError, match="closed"):
        keeper.start()


def test_keeper_as_context_manager_and_close_without_release(ckdir: str) -> None:
    leases = Leases(ckdir)
    with LeaseKeeper(leases, "eval", ttl=5.0, reading=1) as keeper:
        assert read_lease(leases, "eval").reading == 1
        with pytest.raises(RuntimeError, match="already started"):
            keeper.start()
    assert read_lease(leases, "eval") is None and not keeper._thread.is_alive()

    keeper = LeaseKeeper(leases, "eval", ttl=5.0)
    keeper.update(after=4)  # before start(): only sets the values
    assert read_lease(leases, "eval") is None
    keeper.start().close(release=False)
    assert read_lease(leases, "eval").after == 4  # left to expire


def test_keeper_logs_a_failed_renewal_and_recovers(ckdir: str, monkeypatch, caplog) -> None:
    leases = Leases(ckdir)
    original = Storage.write_atomic
    failures = []

    def flaky(self, path, data):
        if not failures:
            failures.append(path)
            raise OSError("store unavailable")
        return original(self, path, data)

    keeper = LeaseKeeper(leases, "eval", ttl=0.6, renew_every=0.05, after=2).start()
    first = read_lease(leases, "eval")
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        monkeypatch.setattr(Storage, "write_atomic", flaky)
        wait_for(lambda: failures and read_lease(leases, "eval").expires > first.expires, what="recovery")
    assert keeper._thread.is_alive()
    assert "could not renew lease 'eval'" in caplog.text and "store unavailable" in caplog.text
    keeper.close()
    assert read_lease(leases, "eval") is None


def test_keeper_update_raises_when_the_write_fails_and_keeps_the_values(ckdir: str, monkeypatch) -> None:
    leases = Leases(ckdir)
    keeper = LeaseKeeper(leases, "eval", ttl=0.6, renew_every=0.05).start()

    def broken(self, path, data):
        raise OSError("store unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "write_atomic", broken)
        with pytest.raises(OSError):
            keeper.update(reading=11)
    assert keeper.reading == 11
    wait_for(lambda: read_lease(leases, "eval").reading == 11, what="the retried renewal")
    keeper.close()


def test_keeper_update_from_another_thread_while_renewing(ckdir: str) -> None:
    leases = Leases(ckdir)
    with LeaseKeeper(leases, "eval", ttl=1.0, renew_every=0.01, after=0) as keeper:
        threads = [threading.Thread(target=lambda i=i: keeper.update(reading=i)) for i in range(1, 9)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        final = keeper.reading
        time.sleep(0.05)  # a few renewals: none writes stale values
        assert read_lease(leases, "eval").reading == final


def test_keeper_protects_during_retention(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1)
    save(manager, 10)
    with LeaseKeeper(Leases(ckdir), "eval", ttl=5.0, after=10):
        assert save(manager, 20, 30) == [20, 30]
    assert save(manager, 40) == [40]


# -- kill -9 -------------------------------------------------------------------------------------

READER = textwrap.dedent(
    """
    import sys, time
    from cadence.checkpoint.lease_keeper import LeaseKeeper
    from cadence.checkpoint.leases import Leases
    keeper = LeaseKeeper(Leases(sys.argv[1]), "sidecar", ttl=2.5, renew_every=0.1, after=10).start()
    print("LEASED", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.timeout(30)
def test_killed_reader_lease_expires(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=2)
    save(manager, 10)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", READER, ckdir], stdout=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 15.0)
        assert ready, "the reader did not start"
        assert proc.stdout.readline().strip() == b"LEASED"
        assert save(manager, 20, 30, 40) == [20, 30, 40]  # 10 is not leased
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    leases = Leases(ckdir)
    [dead] = leases.read_all()
    assert dead.holder == "sidecar" and dead.pid == proc.pid
    assert save(manager, 50) == [20, 30, 40, 50]  # still protected right after the kill
    time.sleep(max(0.0, dead.expires - time.time()) + 0.02)
    assert leases.active() == []
    assert save(manager, 60) == [50, 60]
