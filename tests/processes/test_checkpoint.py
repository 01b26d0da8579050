"""Tests of cadence.checkpoint: commit protocol, crash safety, retention, corruption, memory://."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.checkpoint.leases import Leases
from cadence.checkpoint import CheckpointManager, Storage
from cadence.checkpoint.retention import kept_every_n, steps_to_delete
from cadence.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

HERE = Path(__file__).resolve().parents[1]


# -- objects to checkpoint ---------------------------------------------------------------------


class Blob:
    """Checkpointable: writes its files; its JSON value is ``meta``. Records every load."""

    def __init__(self, files: dict[str, bytes] | None = None, meta: object = None) -> None:
        self.files = dict(files or {})
        self.meta = meta
        self.saves = 0
        self.loads: list[tuple[int, object]] = []

    def save_checkpoint(self, writer):
        self.saves += 1
        for name, data in self.files.items():
            writer.write(name, data)
        return self.meta

    def load_checkpoint(self, reader, state):
        self.files = {name: reader.read(name) for name in reader.names() if name != "state.json"}
        self.meta = state
        self.loads.append((reader.step, state))


class Counter:
    """Stateful: a JSON state dict."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.loads = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
        self.loads += 1


def save_n(manager: CheckpointManager, step: int, **extra) -> str:
    """Save a checkpoint whose contents identify ``step``."""
    blob = Blob({"data.bin": f"payload-{step}".encode() * 10}, meta={"step": step})
    return manager.save(step, {"blob": blob, "counter": Counter(step), **extra})


@pytest.fixture
def ckdir(tmp_path: Path) -> str:
    return str(tmp_path / "model" / "checkpoints")


# -- round trip, layout, manifest ----------------------------------------------------------------


def test_round_trip_files_and_state(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    blob = Blob({"weights.bin": os.urandom(10_000), "extra.bin": b""}, meta={"shape": [2, 3]})
    path = manager.save(7, {"model": blob, "counter": Counter(41)})

    assert path == os.path.join(ckdir, "ckpt-7")
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "extra.bin", "state.json", "weights.bin"]
    assert manager.steps() == [7] and manager.latest_step() == 7

    state = json.loads(Path(path, "state.json").read_bytes())
    assert state["step"] == 7 and isinstance(state["time"], float)
    assert state["state"] == {"model": {"shape": [2, 3]}, "counter": {"value": 41}}
    assert isinstance(state["cadence_version"], str)
    assert manager.read_state(7) == state

    restored, counter = Blob(), Counter()
    assert CheckpointManager(ckdir, writer=False).restore({"model": restored, "counter": counter}) == 7
    assert restored.files == blob.files
    assert restored.loads == [(7, {"shape": [2, 3]})]
    assert counter.value == 41


def test_manifest_lists_sizes_and_crc32c(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    path = Path(manager.save(3, {"model": Blob({"a.bin": b"hello", "b.bin": os.urandom(3000)})}))
    manifest = json.loads((path / "MANIFEST.json").read_bytes())
    assert manifest["format"] == "cadence-checkpoint" and manifest["version"] == 2
    assert manifest["step"] == 3 and isinstance(manifest["time"], float)
    assert set(manifest["files"]) == {"a.bin", "b.bin", "state.json"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32c": f"{crc32c.crc32c(data):08x}"}
    assert manager.manifest(3) == manifest
    info = manager.info(3)
    assert info["step"] == 3 and info["time"] == manifest["time"]
    assert info["size"] == sum(e["size"] for e in manifest["files"].values())


def test_streamed_file_is_hashed_while_written(ckdir: str) -> None:
    chunks = [b"abc", bytearray(b"defg"), memoryview(b"0123456789")[2:8]]

    class Streamer:
        def save_checkpoint(self, writer):
            assert writer.step == 5
            with writer.open("stream.bin") as f:
                for chunk in chunks:
                    f.write(chunk)
                assert f.tell() == 13
            return None

        def load_checkpoint(self, reader, state):
            self.data = reader.read("stream.bin")

    manager = CheckpointManager(ckdir)
    manager.save(5, {"s": Streamer()})
    expected = b"abcdefg234567"
    assert manager.manifest(5)["files"]["stream.bin"] == {"size": 13, "crc32c": f"{crc32c.crc32c(expected):08x}"}
    target = Streamer()
    manager.restore({"s": target})
    assert target.data == expected


def test_manifest_is_written_last(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    save_n(manager, 1)
    events: list[tuple[str, str]] = []
    depth = [0]  # record outermost calls only (write_bytes writes through open_write)
    storage = manager.storage
    for method in ("open_write", "write_atomic", "rename", "write_bytes"):
        original = getattr(storage, method)

        def spy(path, *args, _original=original, _method=method, **kwargs):
            if depth[0] == 0:
                events.append((_method, path))
            depth[0] += 1
            try:
                return _original(path, *args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(storage, method, spy)
    for method in ("fsync_file", "fsync_dir"):  # on helper threads: recorded once done
        original = getattr(storage, method)

        def synced(path, _original=original, _method=method):
            _original(path)
            events.append((_method, path))

        setattr(storage, method, synced)

    class Inspector(Blob):
        def save_checkpoint(self, writer):
            # Mid-save: no manifest anywhere, the checkpoint is not listed, not even its directory.
            assert manager.steps() == [1]
            assert not Path(ckdir, "ckpt-2").exists()
            assert not list(Path(ckdir).glob("ckpt-2*/MANIFEST.json"))
            assert len(list(Path(ckdir).glob("ckpt-2.tmp-*"))) == 1
            return super().save_checkpoint(writer)

    manager.save(2, {"x": Inspector({"a.bin": b"a", "b.bin": b"b"})})

    ckpt = Path(ckdir, "ckpt-2")
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 2  # the directory, then the manifest's temp file: the commit
    assert "ckpt-2.tmp-" in events[renames[0]][1] and ".tmp-" in events[renames[1]][1]
    assert events[renames[1]][1].startswith(str(ckpt / "MANIFEST.json.tmp-"))
    written = [os.path.basename(p) for kind, p in events if kind in ("open_write", "write_bytes")]
    assert written[:3] == ["a.bin", "b.bin", "state.json"] and written[3].startswith("MANIFEST.json.tmp-")
    assert all("ckpt-2.tmp-" in p for kind, p in events if kind in ("open_write", "write_bytes"))
    # Every file, the manifest too, is durable before the commit; both directories after it.
    synced = {os.path.basename(p) for kind, p in events[:renames[0]] if kind == "fsync_file"}
    assert {"a.bin", "b.bin", "state.json"} <= synced and any(n.startswith("MANIFEST.json.tmp-") for n in synced)
    assert sorted(p for kind, p in events[renames[1] + 1:] if kind == "fsync_dir") == sorted([ckdir, str(ckpt)])
    assert not [e for e in events[renames[1] + 1:] if e[0] != "fsync_dir"]
    manifest_mtime = (ckpt / "MANIFEST.json").stat().st_mtime_ns
    assert all(f.stat().st_mtime_ns <= manifest_mtime for f in ckpt.iterdir())


# -- crash safety --------------------------------------------------------------------------------


def test_kill_9_mid_save_leaves_only_an_invisible_temp_dir(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=None)
    save_n(manager, 1)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "checkpoint_writer_proc.py"), ckdir, "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    temps = list(Path(ckdir).glob("ckpt-2.tmp-*"))
    assert len(temps) == 1 and (temps[0] / "big.bin").stat().st_size > 0
    assert not Path(ckdir, "ckpt-2").exists()
    assert manager.steps() == [1]

    reader = CheckpointManager(ckdir, writer=False)
    assert reader.steps() == [1]
    assert list(Path(ckdir).glob("ckpt-2.tmp-*")) == temps  # readers change nothing
    counter = Counter()
    assert reader.restore({"counter": counter}) == 1 and counter.value == 1

    restarted = CheckpointManager(ckdir)
    assert list(Path(ckdir).glob("ckpt-2.tmp-*")) == []
    assert restarted.steps() == [1]
    save_n(restarted, 2)
    assert restarted.steps() == [1, 2]


def test_writer_start_up_removes_leftovers(ckdir: str, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(ckdir)
    save_n(manager, 1)
    Path(ckdir, "ckpt-3").mkdir()  # renamed but killed before its manifest
    Path(ckdir, "ckpt-3", "data.bin").write_bytes(b"x")
    Path(ckdir, "ckpt-4.tmp-abc123").mkdir()
    Path(ckdir, "FINAL.tmp-0a0a").write_bytes(b"{")
    Path(ckdir, ".leases").mkdir()
    Path(ckdir, "notes.txt").write_text("mine")
    assert manager.steps() == [1]

    CheckpointManager(ckdir, writer=False)
    assert Path(ckdir, "ckpt-3").exists() and Path(ckdir, "ckpt-4.tmp-abc123").exists()

    with caplog.at_level(logging.INFO, logger="cadence.checkpoint"):
        CheckpointManager(ckdir)
    assert sorted(os.listdir(ckdir)) == [".leases", "ckpt-1", "notes.txt"]
    assert "ckpt-3" in caplog.text and "ckpt-4.tmp-abc123" in caplog.text


@pytest.mark.parametrize("where", ["local", "memory"])
def test_failing_save_leaves_nothing(where: str, ckdir: str, memdir: str) -> None:
    directory = ckdir if where == "local" else memdir
    manager = CheckpointManager(directory)
    save_n(manager, 1)

    class Failing:
        def save_checkpoint(self, writer):
            writer.write("first.bin", b"x" * 100)
            with writer.open("second.bin") as f:
                f.write(b"partial")
                raise RuntimeError("disk on fire")

        def load_checkpoint(self, reader, state):
            pass

    with pytest.raises(RuntimeError, match="disk on fire"):
        manager.save(2, {"counter": Counter(2), "bad": Failing()})
    assert manager.steps() == [1]
    assert manager.storage.listdir(manager.storage.root) == ["ckpt-1"]
    save_n(manager, 2)  # the step can be saved again afterwards
    assert manager.steps() == [1, 2]


def test_save_is_idempotent(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    blob = Blob({"a.bin": b"first"})
    path = manager.save(4, {"b": blob})
    before = Path(path, "MANIFEST.json").read_bytes()
    blob.files = {"a.bin": b"second"}
    assert manager.save(4, {"b": blob}) == path
    assert blob.saves == 1
    assert Path(path, "MANIFEST.json").read_bytes() == before
    assert Path(path, "a.bin").read_bytes() == b"first"


@pytest.mark.parametrize(
    "names, match",
    [
        (["a/b.bin"], "plain name"),
        (["../escape"], "plain name"),
        ([".."], "plain name"),
        ([""], "non-empty"),
        (["MANIFEST.json"], "reserved"),
        (["state.json"], "reserved"),
        (["a.bin", "a.bin"], "twice"),
    ],
)
def test_bad_file_names_are_rejected(ckdir: str, names: list[str], match: str) -> None:
    class Writer:
        def save_checkpoint(self, writer):
            for name in names:
                writer.write(name, b"x")

        def load_checkpoint(self, reader, state):
            pass

    manager = CheckpointManager(ckdir)
    with pytest.raises(ValueError, match=match):
        manager.save(1, {"w": Writer()})
    assert manager.steps() == [] and os.listdir(ckdir) == []


def test_objects_must_be_checkpointable_and_json(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    with pytest.raises(TypeError, match="'thing'.*object"):
        manager.save(1, {"thing": object()})
    with pytest.raises(TypeError, match="'thing'"):
        manager.restore({"thing": object()})

    class NotJson:
        def state_dict(self):
            return {"x": {1, 2}}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TypeError, match="'bad'.*JSON"):
        manager.save(1, {"ok": Counter(), "bad": NotJson()})
    assert manager.steps() == [] and os.listdir(ckdir) == []


def test_writer_is_closed_after_save(ckdir: str) -> None:
    kept = []

    class Keeper:
        def save_checkpoint(self, writer):
            kept.append(writer)

        def load_checkpoint(self, reader, state):
            pass

    manager = CheckpointManager(ckdir)
    manager.save(1, {"k": Keeper()})
    with pytest.raises(CheckpointError, match="closed"):
        kept[0].write("late.bin", b"x")


# -- restore ---------------------------------------------------------------------------------


def test_restore_without_checkpoints_returns_none(ckdir: str) -> None:
    counter = Counter(5)
    assert CheckpointManager(ckdir, writer=False).restore({"c": counter}) is None
    assert counter.value == 5 and counter.loads == 0
    assert not Path(ckdir).exists()  # a reader creates nothing
    assert CheckpointManager(ckdir).restore({"c": counter}) is None


def test_restore_explicit_step_and_missing_step(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=None)
    for step in (10, 20, 30):
        save_n(manager, step)
    counter = Counter()
    assert manager.restore({"counter": counter}, step=20) == 20 and counter.value == 20
    with pytest.raises(CheckpointError, match=r"step 25.*\[10, 20, 30\]"):
        manager.restore({"counter": counter}, step=25)
    assert counter.value == 20


def test_restore_skips_absent_stateful_and_gives_none_to_checkpointable(
    ckdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(ckdir)
    manager.save(1, {"counter": Counter(3)})
    late, blob = Counter(9), Blob()
    with caplog.at_level(logging.DEBUG, logger="cadence.checkpoint"):
        assert manager.restore({"counter": Counter(), "late": late, "blob": blob}) == 1
    assert late.value == 9 and late.loads == 0 and "'late'" in caplog.text
    assert blob.loads == [(1, None)]


def test_errors_from_loading_objects_propagate_without_fallback(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=None)
    save_n(manager, 1)
    save_n(manager, 2)

    class Refuses:
        def load_checkpoint(self, reader, state):
            raise UnsafeCheckpointError(f"{reader.path}: would unpickle code")

    with pytest.raises(UnsafeCheckpointError, match="ckpt-2"):
        manager.restore({"r": Refuses()})
    with pytest.raises(CheckpointError, match="no file 'nope.bin'"):
        manager.restore({"r": type("R", (), {"load_checkpoint": lambda self, r, s: r.read("nope.bin")})()})


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _bad_state(ckpt: Path) -> None:
    """A state.json that matches its manifest but is not a state document."""
    (ckpt / "state.json").write_bytes(b"[]")
    _manifest_with(ckpt, **{"state.json": {"size": 2, "sha256": hashlib.sha256(b"[]").hexdigest()}})


def _manifest_with(ckpt: Path, **files) -> None:
    manifest = json.loads((ckpt / "MANIFEST.json").read_bytes())
    manifest["files"].update(files)
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


CORRUPTIONS = {
    "flipped byte": (lambda c: _flip(c / "data.bin"), "does not match its crc32c"),
    "truncated": (lambda c: (c / "data.bin").write_bytes((c / "data.bin").read_bytes()[:5]), "truncated"),
    "deleted file": (lambda c: (c / "data.bin").unlink(), "data.bin is missing"),
    "garbage manifest": (lambda c: (c / "MANIFEST.json").write_bytes(b"\x00{not json"), "not valid JSON"),
    "unsafe name": (lambda c: _manifest_with(c, **{"../x": {"size": 0, "sha256": "0" * 64}}), "plain name"),
    "changed state.json": (lambda c: (c / "state.json").write_bytes(b"[]"), "truncated or changed"),
    "bad state.json": (_bad_state, "no 'state' object"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back_to_previous(ckdir: str, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    corrupt, reason = CORRUPTIONS[kind]
    writer = CheckpointManager(ckdir, max_to_keep=None)
    save_n(writer, 1)
    save_n(writer, 2)
    corrupt(Path(ckdir, "ckpt-2"))
    manager = CheckpointManager(ckdir, writer=False)  # a reader falls back and moves nothing
    assert manager.steps() == [1, 2]  # listing is cheap: no hashing

    blob, counter = Blob(), Counter(-1)
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert manager.restore({"counter": counter, "blob": blob}) == 1
    assert blob.loads == [(1, {"step": 1})] and counter.value == 1 and counter.loads == 1
    assert blob.files["data.bin"] == b"payload-1" * 10
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert os.path.join(ckdir, "ckpt-2") in record.getMessage() and reason in record.getMessage()

    # Everything is verified before any object is called: the counter (first, and whose state is
    # fine unless state.json is the damaged file) is not loaded either.
    untouched, counter = Blob(), Counter(-1)
    with pytest.raises(CorruptCheckpointError, match=reason) as info:
        manager.restore({"counter": counter, "blob": untouched}, step=2)
    assert info.value.path == os.path.join(ckdir, "ckpt-2")
    assert untouched.loads == [] and counter.loads == 0 and counter.value == -1


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_writer_moves_a_corrupt_latest_aside_and_saves_the_step_anew(ckdir: str, kind: str) -> None:
    """Issue 12: the corrupt ckpt-2 is never silently kept (later resumes would fall back again)
    nor deleted: it is moved to ckpt-2.corrupt-<time>-<hex>/, and step 2 is saved anew."""
    corrupt, _ = CORRUPTIONS[kind]
    first = CheckpointManager(ckdir, max_to_keep=None)
    save_n(first, 1)
    save_n(first, 2)
    corrupt(Path(ckdir, "ckpt-2"))
    damaged = sorted(p.name for p in Path(ckdir, "ckpt-2").iterdir())
    writer = CheckpointManager(ckdir, max_to_keep=None)  # a resumed trainer
    assert writer.restore({"blob": Blob(), "counter": Counter()}) == 1
    assert writer.steps() == [1]
    [aside] = writer.quarantined()
    assert aside.startswith("ckpt-2.corrupt-") and sorted(p.name for p in Path(ckdir, aside).iterdir()) == damaged
    save_n(writer, 2)  # retrained to step 2: saved anew, not skipped as "already committed"
    blob = Blob()
    assert CheckpointManager(ckdir, writer=False).restore({"blob": blob}) == 2 and blob.meta == {"step": 2}
    assert writer.quarantined() == [aside]  # kept, listed apart, never retained or cleaned up
    CheckpointManager(ckdir, max_to_keep=1)  # a writer's start-up clean-up leaves it too
    assert Path(ckdir, aside).is_dir()


def test_saving_over_a_corrupt_checkpoint_of_another_run_replaces_it(ckdir: str) -> None:
    """A step committed by an earlier process is verified before a save at that step is skipped."""
    save_n(CheckpointManager(ckdir), 3)
    _flip(Path(ckdir, "ckpt-3", "data.bin"))
    writer = CheckpointManager(ckdir)
    save_n(writer, 3)
    assert len(writer.quarantined()) == 1
    blob = Blob()
    assert writer.restore({"blob": blob}, step=3) == 3 and blob.files["data.bin"] == b"payload-3" * 10
    again = Blob({"data.bin": b"other"})
    writer.save(3, {"blob": again})  # committed by this manager and good: written once
    assert again.saves == 0


def test_all_checkpoints_corrupt_raises(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    save_n(manager, 1)
    _flip(Path(ckdir, "ckpt-1", "data.bin"))
    counter = Counter(-1)
    with pytest.raises(CheckpointError, match="corrupt"):
        manager.restore({"counter": counter})
    assert counter.loads == 0
    assert manager.quarantined() == [] and manager.steps() == [1]  # kept: the refusal holds on every run


def test_read_state_checks_state_json(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    save_n(manager, 1)
    assert manager.read_state(1)["state"]["counter"] == {"value": 1}
    _flip(Path(ckdir, "ckpt-1", "state.json"))
    with pytest.raises(CorruptCheckpointError, match="state.json"):
        manager.read_state(1)
    with pytest.raises(CheckpointError, match="step 2"):
        manager.read_state(2)


# -- retention -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_to_keep, expected",
    [(None, [10, 20, 30, 40, 50]), (0, [50]), (2, [40, 50]), (5, [10, 20, 30, 40, 50])],
)
def test_max_to_keep(ckdir: str, max_to_keep: int | None, expected: list[int]) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=max_to_keep)
    for step in (10, 20, 30, 40, 50):
        save_n(manager, step)
    assert manager.steps() == expected
    assert sorted(os.listdir(ckdir)) == [".leases"] * (len(expected) < 5) + [f"ckpt-{s}" for s in sorted(expected, key=str)]
    if len(expected) < 5:  # retention noted what it deleted, for readers that never saw it
        assert Leases(ckdir).deleted() == [s for s in (10, 20, 30, 40, 50) if s not in expected]


def test_just_saved_checkpoint_is_never_deleted(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=2)
    for step in (10, 20, 5):  # e.g. after a roll-back
        save_n(manager, step)
    assert manager.steps() == [5, 10, 20]
    save_n(manager, 30)
    assert manager.steps() == [20, 30]


def test_delete_removes_a_committed_checkpoint(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=None)
    for step in (10, 20):
        save_n(manager, step)
    manager.delete(10)
    assert manager.steps() == [20]
    assert not os.path.exists(os.path.join(ckdir, "ckpt-10"))
    with pytest.raises(CheckpointError, match="no committed checkpoint for step 10"):
        manager.delete(10)
    with pytest.raises(CheckpointError, match="reader"):
        CheckpointManager(ckdir, writer=False).delete(20)


def test_keep_every_n_steps_with_unaligned_intervals(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=1, keep_every_n_steps=10)
    for step in range(7, 60, 7):  # 7, 14, ..., 56
        save_n(manager, step)
    # First checkpoint at or after each multiple of 10: 14 (10), 21 (20), 35 (30), 42 (40), 56 (50).
    assert manager.steps() == [14, 21, 35, 42, 56]
    assert kept_every_n([7, 14, 21, 28, 35], 10) == {14, 21, 35}
    assert kept_every_n([10, 20], 10) == {10, 20} and kept_every_n([0, 3], 10) == set()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=30, unique=True), st.integers(1, 25))
def test_keep_every_n_is_stable_under_retention(steps: list[int], n: int) -> None:
    kept = kept_every_n(steps, n)
    # The first checkpoint at or after each multiple of n.
    assert kept == {min(s for s in steps if s >= m) for m in range(n, max(steps) + 1, n)}
    assert kept_every_n(kept, n) == kept  # deleting the others changes nothing
    doomed = steps_to_delete(steps, just_saved=steps[-1], max_to_keep=0, keep_every_n_steps=n)
    assert set(doomed) == set(steps) - kept - {steps[-1]}


def test_protected_steps_are_kept(ckdir: str, caplog: pytest.LogCaptureFixture) -> None:
    leases = {10}
    manager = CheckpointManager(ckdir, max_to_keep=1, protected_steps=lambda: leases)
    for step in (10, 20, 30):
        save_n(manager, step)
    assert manager.steps() == [10, 30]
    leases.clear()
    save_n(manager, 40)
    assert manager.steps() == [40]

    def broken():
        raise RuntimeError("lease dir unreadable")

    manager.protected_steps = broken
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        save_n(manager, 50)
    assert manager.steps() == [40, 50] and "protected_steps" in caplog.text


# -- memory:// (no atomic rename) -----------------------------------------------------------------


def test_memory_store_round_trip_and_retention(memdir: str) -> None:
    manager = CheckpointManager(memdir, max_to_keep=2)
    assert not manager.storage.atomic_rename
    renames = []
    manager.storage.rename = lambda *a: renames.append(a)  # type: ignore[method-assign]
    for step in (1, 2, 3):
        path = save_n(manager, step)
    assert path.startswith("memory://") and path.endswith("/checkpoints/ckpt-3")
    assert renames == []  # files went straight into ckpt-N/
    assert manager.steps() == [2, 3]
    assert manager.storage.listdir(manager.storage.root) == [".leases", "ckpt-2", "ckpt-3"]  # .leases: the note
    assert Leases(memdir).deleted() == [1]

    blob, counter = Blob(), Counter()
    assert CheckpointManager(memdir, writer=False).restore({"blob": blob, "counter": counter}) == 3
    assert blob.files == {"data.bin": b"payload-3" * 10} and counter.value == 3
    assert manager.info(3)["size"] == sum(e["size"] for e in manager.manifest(3)["files"].values())


def test_memory_store_half_written_checkpoint(memdir: str) -> None:
    manager = CheckpointManager(memdir)
    save_n(manager, 1)
    storage = manager.storage
    storage.makedirs(storage.join("ckpt-2"))
    storage.write_bytes(storage.join("ckpt-2", "data.bin"), b"half")
    assert manager.steps() == [1]
    assert CheckpointManager(memdir, writer=False).latest_step() == 1
    assert storage.exists(storage.join("ckpt-2", "data.bin"))

    CheckpointManager(memdir)
    assert not storage.exists(storage.join("ckpt-2"))
    assert storage.listdir(storage.root) == ["ckpt-1"]


def test_memory_store_corruption_falls_back(memdir: str, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(memdir, max_to_keep=None)
    save_n(manager, 1)
    save_n(manager, 2)
    storage = manager.storage
    storage.write_bytes(storage.join("ckpt-2", "data.bin"), b"tampered")
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert manager.restore({"counter": counter}) == 1
    assert counter.value == 1 and manager.path(2) in caplog.text


# -- FINAL, readers, storage ----------------------------------------------------------------------


def test_final_round_trip(ckdir: str, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(ckdir)
    assert manager.final_step() is None
    with pytest.raises(CheckpointError, match="step 3"):
        manager.mark_final(3)
    save_n(manager, 3)
    manager.mark_final(3)
    assert json.loads(Path(ckdir, "FINAL").read_bytes())["step"] == 3
    reader = CheckpointManager(ckdir, writer=False)
    assert reader.final_step() == 3
    with pytest.raises(CheckpointError, match="reader"):
        reader.clear_final()
    manager.clear_final()
    manager.clear_final()
    assert manager.final_step() is None and sorted(os.listdir(ckdir)) == ["ckpt-3"]
    Path(ckdir, "FINAL").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert manager.final_step() is None
    assert "FINAL" in caplog.text


def test_reader_cannot_write(ckdir: str) -> None:
    reader = CheckpointManager(ckdir, writer=False)
    assert reader.steps() == [] and reader.latest_step() is None
    with pytest.raises(CheckpointError, match="reader"):
        save_n(reader, 1)
    with pytest.raises(CheckpointError, match="reader"):
        reader.mark_final(1)
    assert not Path(ckdir).exists()


def test_invalid_arguments(ckdir: str) -> None:
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(ckdir, max_to_keep=-1)
    with pytest.raises(ValueError, match="keep_every_n_steps"):
        CheckpointManager(ckdir, keep_every_n_steps=0)
    manager = CheckpointManager(ckdir)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step"):
            manager.save(bad, {})  # type: ignore[arg-type]


def test_steps_ignore_padded_and_foreign_names(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, max_to_keep=None)
    save_n(manager, 2)
    save_n(manager, 10)
    for name in ("ckpt-010", "ckpt-x", "checkpoint-3"):
        Path(ckdir, name).mkdir()
        Path(ckdir, name, "MANIFEST.json").write_text("{}")
    assert manager.steps() == [2, 10]


def test_storage_local_basics(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "s"))
    assert storage.atomic_rename
    assert storage.listdir(storage.root) == []
    storage.makedirs(storage.join("d"))
    storage.write_atomic(storage.join("d", "f"), b"one")
    storage.write_atomic(storage.join("d", "f"), b"two")
    assert storage.read_bytes(storage.join("d", "f")) == b"two"
    assert storage.listdir(storage.join("d")) == ["f"]  # no temp file left behind
    assert storage.size(storage.join("d", "f")) == 3 and storage.mtime(storage.join("d", "f")) is not None
    storage.rename(storage.join("d"), storage.join("e"))
    assert storage.isdir(storage.join("e")) and not storage.exists(storage.join("d"))
    storage.remove(storage.join("e", "f"))
    storage.rmtree(storage.join("e"))
    storage.rmtree(storage.join("e"))
    assert storage.listdir(storage.root) == []


def test_storage_open_atomic_streams_and_leaves_nothing_on_error(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    target = storage.join("f")
    with storage.open_atomic(target) as f:
        f.write(b"one ")
        f.write(b"two")
    assert storage.read_bytes(target) == b"one two"
    with pytest.raises(RuntimeError, match="mid-write"):
        with storage.open_atomic(target) as f:
            f.write(b"half")
            raise RuntimeError("mid-write")
    assert storage.read_bytes(target) == b"one two"  # untouched
    assert storage.listdir(storage.root) == ["f"]  # the temp file is gone


@pytest.mark.parametrize("algorithm", ["crc32c", "xxh3_128", "sha256"])
def test_large_file_hashed_in_chunks_matches_one_pass(ckdir: str, algorithm: str) -> None:
    import xxhash

    data = os.urandom(3 * (8 << 20) + 12345)  # several chunks and a partial one
    one_pass = {"crc32c": lambda d: f"{crc32c.crc32c(d):08x}", "xxh3_128": lambda d: xxhash.xxh3_128_hexdigest(d),
                "sha256": lambda d: hashlib.sha256(d).hexdigest()}[algorithm]

    class Big:
        def save_checkpoint(self, writer):
            writer.write("big.bin", data)
            return None

    manager = CheckpointManager(ckdir, checksum=algorithm)
    manager.save(1, {"big": Big()})
    entry = manager.manifest(1)["files"]["big.bin"]
    on_disk = (Path(ckdir) / "ckpt-1" / "big.bin").read_bytes()
    assert on_disk == data
    assert entry == {"size": len(data), algorithm: one_pass(data)}
    reader, _ = manager.read(1)
    assert reader.read("big.bin") == data


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_large_files_are_verified_while_read_in_chunks(ckdir: str, damage: str) -> None:
    """Files over the 8 MiB chunk are read and hashed chunk by chunk: damage anywhere is found."""
    payload = bytes(range(256)) * (80_000)  # 20 MB: several chunks, not a multiple of the chunk
    manager = CheckpointManager(ckdir)
    manager.save(1, {"blob": Blob({"big.bin": payload})})
    blob = Blob()
    assert manager.restore({"blob": blob}, step=1) == 1 and blob.files["big.bin"] == payload
    path = Path(ckdir, "ckpt-1", "big.bin")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 3_000_000] ^= 1  # in the third chunk
    elif damage == "truncate":
        del data[-1]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    reason = "does not match its crc32c" if damage == "flip" else "truncated or changed"
    with pytest.raises(CorruptCheckpointError, match=reason):
        manager.restore({"blob": Blob()}, step=1)
