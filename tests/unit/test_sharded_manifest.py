"""Sharded checkpoints, the framework-agnostic half: manifest version 3 (files tagged with the
rank that wrote them), ``CheckpointManager.begin`` + ``DirectoryWriter.add_files``, the
collective restore (each rank verifies its share, the ranks agree), ``VerifiedReader``'s
fetch of files left to other ranks, and ``CheckpointSession``'s sharded save. No torch: the
"ranks" are threads, their shards plain files."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from cadence.checkpoint import CheckpointManager, MANIFEST_NAME, STATE_NAME
from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint import manifest as manifest_lib
from cadence.checkpoint.files import DirectoryWriter, MemoryWriter, Snapshot, VerifiedReader
from cadence.checkpoint.protocol import ShardTarget, WritesShards
from cadence.checkpoint.session import CheckpointSession
from cadence.storage import Storage
from cadence.errors import CheckpointError, CorruptCheckpointError

ALGORITHM = checksum_lib.DEFAULT_ALGORITHM


def digest(data: bytes) -> str:
    return checksum_lib.checksum_of(ALGORITHM, data)


def shard_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def shard_bytes(step: int, rank: int) -> bytes:
    return f"shard of rank {rank} at step {step};".encode() * (50 + 10 * rank)


# -- a threaded coordinator: two "ranks" in one process ----------------------------------------


class ThreadGroup:
    """What the ranks of one in-process "job" share: a barrier and one slot per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list[Any] = [None] * world_size
        self.calls: list[tuple[int, str]] = []


class ThreadCoordinator:
    """A :class:`~cadence.runtime.coordination.Coordinator` over threads: real collectives (every rank
    blocks until all have called), so a rank that skips one makes the others fail, not pass."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def _exchange(self, what: str, obj: Any) -> list[Any]:
        self.group.calls.append((self.rank, what))
        self.group.slots[self.rank] = obj
        self.group.barrier.wait()
        gathered = list(self.group.slots)
        self.group.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return gathered

    def any(self, flag: bool) -> bool:
        return any(self._exchange("any", bool(flag)))

    def barrier(self) -> None:
        self._exchange("barrier", None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._exchange("broadcast", obj)[src]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange("all_gather", obj)


def run_ranks(world_size: int, body: Callable[[ThreadCoordinator], Any],
              calls: list[list[str]] | None = None) -> list[tuple[str, Any]]:
    """Run ``body(coordinator)`` on ``world_size`` threads; each rank's ``("ok", result)`` or
    ``("raised", exception)``. Once a rank has raised, the others get two seconds to finish
    before the barrier is broken (a rank left waiting in a collective raises
    ``BrokenBarrierError``, it does not hang)."""
    group = ThreadGroup(world_size)
    outcomes: list[tuple[str, Any]] = [("missing", None)] * world_size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = ("ok", body(ThreadCoordinator(group, rank)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcomes[rank] = ("raised", e)

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    give_up = time.monotonic() + 60
    broken_at: float | None = None
    while any(thread.is_alive() for thread in threads):
        threads[0].join(0.02)
        now = time.monotonic()
        if broken_at is None and any(kind == "raised" for kind, _ in outcomes):
            broken_at = now + 2
        if broken_at is not None and now > broken_at:
            group.barrier.abort()
        assert now < give_up, "a rank hangs"
    if calls is not None:  # each rank's collectives, in order
        calls.extend([what for rank, what in group.calls if rank == r] for r in range(world_size))
    return outcomes


# -- objects --------------------------------------------------------------------------------------


class ShardedModel:
    """Savable like a sharded trainer's snapshot: the ranks' files are already in the begun
    directory (written there by :func:`write_rank_files`), the chief's ``save_checkpoint`` adds
    them to the manifest and writes a file of its own. ``load_checkpoint`` reads ``read_ranks``'
    shards through the reader (``None``: none) and the chief's file."""

    def __init__(self, added: dict[int, dict[str, tuple[int, str]]] | None = None, *,
                 read_ranks: tuple[int, ...] | None = (0, 1), own: bytes = b"chief-file") -> None:
        self.added = dict(added or {})
        self.read_ranks = read_ranks
        self.own = own
        self.loaded: dict[str, bytes] = {}
        self.loads: list[tuple[int, Any]] = []
        self.names: list[str] = []

    def save_checkpoint(self, writer):
        writer.write("chief.bin", self.own)
        for rank, files in sorted(self.added.items()):
            writer.add_files(files, rank=rank)
        return {"ranks": sorted(self.added)}

    def load_checkpoint(self, reader, state):
        self.names = reader.names()
        self.loaded = {"chief.bin": reader.read("chief.bin")}
        for rank in self.read_ranks or ():
            self.loaded[shard_name(rank)] = reader.read(shard_name(rank))
        self.loads.append((reader.step, state))


def write_rank_files(directory: str, step: int, rank: int) -> dict[str, tuple[int, str]]:
    """What rank ``rank`` of a sharded save does: write its files into the begun directory and
    report ``{name: (size, checksum)}``. Rank 0 also writes an index file (as DCP's .metadata)."""
    files = {shard_name(rank): shard_bytes(step, rank)}
    if rank == 0:
        files[".metadata"] = f"index of step {step}".encode()
    for name, data in files.items():
        Path(directory, name).write_bytes(data)
    return {name: (len(data), digest(data)) for name, data in files.items()}


def sharded_save(manager: CheckpointManager, step: int, ranks: int = 2) -> dict[int, dict[str, tuple[int, str]]]:
    directory = manager.begin(step)
    assert directory is not None
    added = {rank: write_rank_files(directory, step, rank) for rank in range(ranks)}
    manager.save(step, {"model": ShardedModel(added)})
    return added


def leftovers(ckdir: str) -> list[str]:
    return sorted(name for name in os.listdir(ckdir) if ".tmp-" in name)


@pytest.fixture
def ckdir(tmp_path: Path) -> str:
    return str(tmp_path / "model" / "checkpoints")


def entry(size: int = 3, **extra: Any) -> dict[str, Any]:
    return {"size": size, ALGORITHM: digest(b"abc"), **extra}


def encoded(version: int, files: dict[str, Any], step: int = 5) -> bytes:
    return json.dumps({"format": manifest_lib.FORMAT, "version": version, "step": step, "time": 1.0,
                       "files": files}).encode()


# == 1. manifest version 3 ========================================================================


def test_build_with_ranks_writes_version_3_and_tags_only_the_ranks_files() -> None:
    files = {"state.json": (10, "0" * 8), "__0_0.distcp": (20, "1" * 8), "__1_0.distcp": (30, "2" * 8)}
    document = manifest_lib.build(7, files, algorithm="crc32c", now=3.0,
                                  ranks={"__0_0.distcp": 0, "__1_0.distcp": 1})
    assert document["version"] == 3
    assert document["files"] == {
        "state.json": {"size": 10, "crc32c": "0" * 8},
        "__0_0.distcp": {"size": 20, "crc32c": "1" * 8, "rank": 0},
        "__1_0.distcp": {"size": 30, "crc32c": "2" * 8, "rank": 1},
    }


@pytest.mark.parametrize("ranks", [None, {}])
def test_build_without_ranks_writes_version_2_that_older_readers_know(ranks) -> None:
    document = manifest_lib.build(7, {"a.bin": (3, "0" * 8)}, algorithm="crc32c", now=3.0, ranks=ranks)
    assert document["version"] == 2
    assert document["files"] == {"a.bin": {"size": 3, "crc32c": "0" * 8}}
    assert "rank" not in json.dumps(document)


def test_a_version_3_manifest_round_trips_through_encode_and_parse() -> None:
    files = {"state.json": (10, digest(b"s")), ".metadata": (4, digest(b"m")), "__1_0.distcp": (9, digest(b"x"))}
    document = manifest_lib.build(12, files, now=5.5, ranks={".metadata": 0, "__1_0.distcp": 1})
    parsed = manifest_lib.parse(manifest_lib.encode(document), path="ckpt-12", step=12)
    assert parsed == document
    assert parsed["files"]["__1_0.distcp"]["rank"] == 1
    assert "rank" not in parsed["files"]["state.json"]


def test_entry_checksum_ignores_the_rank() -> None:
    tagged = {"size": 3, "rank": 4, "xxh3_128": "a" * 32}
    assert manifest_lib.entry_checksum(tagged) == ("xxh3_128", "a" * 32)
    assert manifest_lib.entry_checksum({"rank": 0, "size": 1, "crc32c": "0" * 8}) == ("crc32c", "0" * 8)


def test_version_3_parses_entries_with_and_without_a_rank() -> None:
    parsed = manifest_lib.parse(encoded(3, {"a": entry(), "b": entry(rank=0), "c": entry(rank=17)}), path="p", step=5)
    assert [parsed["files"][n].get("rank") for n in "abc"] == [None, 0, 17]


@pytest.mark.parametrize("version", [2, 1])
def test_a_rank_in_an_older_version_is_corrupt(version: int) -> None:
    sha = {"size": 3, "sha256": "0" * 64}
    good = encoded(version, {"a": dict(sha)})
    manifest_lib.parse(good, path="p", step=5)  # the same manifest without the rank is fine
    with pytest.raises(CorruptCheckpointError, match="rank"):
        manifest_lib.parse(encoded(version, {"a": {**sha, "rank": 0}}), path="p", step=5)


@pytest.mark.parametrize("rank", [-1, True, False, "1", 1.0, None, [0]])
def test_a_bad_rank_is_corrupt(rank: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="bad rank"):
        manifest_lib.parse(encoded(3, {"a": entry(rank=rank)}), path="p", step=5)


def test_a_rank_is_not_a_checksum_in_version_3() -> None:
    """An entry with a rank but no checksum is corrupt (the rank is not taken for an algorithm)."""
    with pytest.raises(CorruptCheckpointError, match="one checksum"):
        manifest_lib.parse(encoded(3, {"a": {"size": 3, "rank": 0}}), path="p", step=5)


def test_version_4_is_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match="unsupported version 4"):
        manifest_lib.parse(encoded(4, {"a": entry()}), path="p", step=5)


# == 2. begin + add_files =========================================================================


def test_a_sharded_save_lists_every_ranks_files_with_its_rank(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    directory = manager.begin(3)
    assert directory is not None and Path(directory).parent == Path(ckdir)
    assert Path(directory).name.startswith("ckpt-3.tmp-") and Path(directory).is_dir()
    assert manager.steps() == []  # begun is not committed
    added = {rank: write_rank_files(directory, 3, rank) for rank in (0, 1)}
    path = manager.save(3, {"model": ShardedModel(added)})

    assert path == manager.path(3) and manager.steps() == [3] and leftovers(ckdir) == []
    document = manager.manifest(3)
    assert document["version"] == 3
    files = document["files"]
    assert set(files) == {"chief.bin", STATE_NAME, ".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert {name: e.get("rank") for name, e in files.items()} == {
        "chief.bin": None, STATE_NAME: None, ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}
    assert files["__1_0.distcp"]["size"] == len(shard_bytes(3, 1))
    assert files["__1_0.distcp"][ALGORITHM] == digest(shard_bytes(3, 1))

    reader, state = manager.read(3)  # verifies every file, the ranks' too
    assert reader.read("__1_0.distcp") == shard_bytes(3, 1)
    assert state["state"]["model"] == {"ranks": [0, 1]}

    restored = ShardedModel()
    assert CheckpointManager(ckdir, writer=False).restore({"model": restored}) == 3
    assert restored.loaded == {"chief.bin": b"chief-file", "__0_0.distcp": shard_bytes(3, 0),
                               "__1_0.distcp": shard_bytes(3, 1)}
    assert restored.names == sorted(files)


def test_a_save_without_ranks_files_still_writes_version_2(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    assert manager.begin(1) is not None
    manager.save(1, {"model": ShardedModel({})})
    assert manager.manifest(1)["version"] == 2


def test_a_ranks_file_that_does_not_match_what_it_reported_fails_verification(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    directory = manager.begin(2)
    assert directory is not None
    added = {rank: write_rank_files(directory, 2, rank) for rank in (0, 1)}
    Path(directory, shard_name(1)).write_bytes(b"x" * len(shard_bytes(2, 1)))  # changed after reporting
    manager.save(2, {"model": ShardedModel(added)})
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp does not match"):
        CheckpointManager(ckdir, writer=False).read(2)


@pytest.mark.parametrize("files, rank, match", [
    ({"chief.bin": (1, "0" * 8)}, 1, "written twice"),  # the chief's own file
    ({"__0_0.distcp": (1, "0" * 8)}, 1, "written twice"),  # another rank's file
    ({STATE_NAME: (1, "0" * 8)}, 1, "reserved"),
    ({MANIFEST_NAME: (1, "0" * 8)}, 1, "reserved"),
    ({"a/b": (1, "0" * 8)}, 1, "not a plain name"),
    ({"..": (1, "0" * 8)}, 1, "not a plain name"),
    ({"": (1, "0" * 8)}, 1, "not a non-empty string"),
])
def test_add_files_refuses_bad_names_and_nothing_is_committed(ckdir: str, files, rank: int, match: str) -> None:
    manager = CheckpointManager(ckdir)
    directory = manager.begin(4)
    assert directory is not None
    good = {0: write_rank_files(directory, 4, 0)}

    class Adds(ShardedModel):
        def save_checkpoint(self, writer):
            state = super().save_checkpoint(writer)
            writer.add_files(files, rank=rank)
            return state

    with pytest.raises(ValueError, match=match):
        manager.save(4, {"model": Adds(good)})
    assert manager.steps() == [] and leftovers(ckdir) == [] and os.listdir(ckdir) == []


@pytest.mark.parametrize("files, rank, match", [
    (None, -1, "a rank is an int >= 0"),
    (None, True, "a rank is an int >= 0"),
    (None, "0", "a rank is an int >= 0"),
    (None, None, "a rank is an int >= 0"),
    ({"__1_0.distcp": (-1, "0" * 8)}, 1, "bad size"),
    ({"__1_0.distcp": (1.5, "0" * 8)}, 1, "bad size"),
    ({"__1_0.distcp": (1, "0" * 64)}, 1, "bad crc32c"),  # another algorithm's digest
    ({"__1_0.distcp": (1, "ABCDEF01")}, 1, "bad crc32c"),
])
def test_add_files_refuses_what_the_manifest_could_not_list(ckdir: str, files, rank: object, match: str) -> None:
    """A bad rank, size or checksum would commit a manifest that never verifies: refused."""
    manager = CheckpointManager(ckdir)
    directory = manager.begin(4)
    assert directory is not None
    own = write_rank_files(directory, 4, 0)

    class Adds:
        def save_checkpoint(self, writer):
            writer.add_files({**own, **(files or {})}, rank=rank)

    with pytest.raises(ValueError, match=match):
        manager.save(4, {"model": Adds()})
    assert manager.steps() == [] and os.listdir(ckdir) == []


def test_add_files_records_nothing_when_one_of_the_files_is_refused(tmp_path: Path) -> None:
    writer = DirectoryWriter(Storage(str(tmp_path)), str(tmp_path), 1)
    with pytest.raises(ValueError, match="bad size"):
        writer.add_files({"a": (1, "0" * 8), "b": (-1, "0" * 8)}, rank=1)
    writer.add_files({"a": (1, "0" * 8)}, rank=1)  # "a" was not claimed by the refused call
    assert writer.files() == {"a": (1, "0" * 8)} and writer.ranks() == {"a": 1}


def test_add_files_on_a_closed_writer_is_refused(tmp_path: Path) -> None:
    writer = DirectoryWriter(Storage(str(tmp_path)), str(tmp_path), 1)
    writer.add_files({"a": (1, "0" * 8)}, rank=2)
    assert writer.files() == {"a": (1, "0" * 8)} and writer.ranks() == {"a": 2}
    with pytest.raises(CheckpointError, match="closed"):
        writer.add_files({"b": (1, "0" * 8)}, rank=0)


def test_begin_of_a_committed_step_returns_none_and_saving_it_again_writes_nothing(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    sharded_save(manager, 5)
    before = manager.manifest(5)
    assert manager.begin(5) is None
    assert leftovers(ckdir) == []
    assert manager.save(5, {"model": ShardedModel({})}) == manager.path(5)
    assert manager.manifest(5) == before
    # a manager that did not commit it verifies it first, then also says None
    assert CheckpointManager(ckdir).begin(5) is None


def test_begin_twice_discards_the_first_directory(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    first = manager.begin(6)
    second = manager.begin(6)
    assert first != second and first is not None and second is not None
    assert not Path(first).exists() and Path(second).is_dir()
    added = {rank: write_rank_files(second, 6, rank) for rank in (0, 1)}
    manager.save(6, {"model": ShardedModel(added)})
    assert manager.steps() == [6] and leftovers(ckdir) == []


def test_a_begun_directory_is_discarded_when_the_save_raises(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    directory = manager.begin(7)
    assert directory is not None
    added = {rank: write_rank_files(directory, 7, rank) for rank in (0, 1)}

    class Fails(ShardedModel):
        def save_checkpoint(self, writer):
            super().save_checkpoint(writer)
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        manager.save(7, {"model": Fails(added)})
    assert not Path(directory).exists() and os.listdir(ckdir) == []
    # the step can be begun and saved anew
    sharded_save(manager, 7)
    assert manager.steps() == [7]


def test_a_begun_directory_is_discarded_when_an_object_cannot_be_saved(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    directory = manager.begin(8)
    assert directory is not None
    with pytest.raises(TypeError, match="neither save_checkpoint nor state_dict"):
        manager.save(8, {"model": object()})
    assert os.listdir(ckdir) == []


def test_a_begun_but_never_saved_directory_is_removed_by_the_next_writers_clean_up(ckdir: str) -> None:
    manager = CheckpointManager(ckdir)
    sharded_save(manager, 1)
    directory = manager.begin(2)
    assert directory is not None
    write_rank_files(directory, 2, 0)  # the job dies here
    CheckpointManager(ckdir, writer=False)  # readers change nothing
    assert Path(directory).is_dir()
    CheckpointManager(ckdir)
    assert not Path(directory).exists() and os.listdir(ckdir) == ["ckpt-1"]


def test_an_async_save_passes_the_added_files_through_its_snapshot(ckdir: str) -> None:
    manager = CheckpointManager(ckdir, async_save=True)
    directory = manager.begin(9)
    assert directory is not None
    added = {rank: write_rank_files(directory, 9, rank) for rank in (0, 1)}
    manager.save(9, {"model": ShardedModel(added)})  # no snapshot_checkpoint: captured by a MemoryWriter
    manager.wait()
    files = manager.manifest(9)["files"]
    assert {name: e.get("rank") for name, e in files.items() if "rank" in e} == {
        ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}
    reader, _ = manager.read(9)
    assert reader.read("__1_0.distcp") == shard_bytes(9, 1)


def test_memory_writer_and_snapshot_replay_the_added_files(tmp_path: Path) -> None:
    memory = MemoryWriter(3)
    memory.write("own.bin", b"own")
    memory.add_files({"__1_0.distcp": (5, "1" * 8)}, rank=1)
    memory.add_files({"__2_0.distcp": (6, "2" * 8)}, rank=2)
    snapshot = Snapshot(memory.files, {"s": 1}, memory.added)
    writer = DirectoryWriter(Storage(str(tmp_path)), str(tmp_path), 3)
    assert snapshot.save_checkpoint(writer) == {"s": 1}
    assert writer.ranks() == {"__1_0.distcp": 1, "__2_0.distcp": 2}
    assert writer.files() == {"own.bin": (3, digest(b"own")), "__1_0.distcp": (5, "1" * 8),
                              "__2_0.distcp": (6, "2" * 8)}


# == 3. collective restore ========================================================================


def record_reads(manager: CheckpointManager) -> list[str]:
    """Record the names of the files ``manager``'s storage reads (each rank has its own)."""
    reads: list[str] = []
    lock = threading.Lock()
    original = manager.storage.read_view

    def read_view(path: str, *args: Any, **kwargs: Any) -> memoryview:
        with lock:
            reads.append(os.path.basename(path))
        return original(path, *args, **kwargs)

    manager.storage.read_view = read_view  # type: ignore[method-assign]
    return reads


def rank_managers(ckdir: str) -> list[tuple[CheckpointManager, list[str]]]:
    """The chief's manager (the writer) and rank 1's (a reader), as a job has them, each
    recording its reads."""
    managers = [CheckpointManager(ckdir), CheckpointManager(ckdir, writer=False)]
    return [(m, record_reads(m)) for m in managers]


def corrupt(ckdir: str, step: int, name: str) -> None:
    path = Path(ckdir, f"ckpt-{step}", name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_collective_restore_verifies_each_ranks_files_on_that_rank_only(ckdir: str) -> None:
    sharded_save(CheckpointManager(ckdir), 10)
    ranks = rank_managers(ckdir)
    models = [ShardedModel(read_ranks=(0,)), ShardedModel(read_ranks=(1,))]

    def body(coordinator: ThreadCoordinator) -> int | None:
        manager, _ = ranks[coordinator.rank]
        return manager.restore({"model": models[coordinator.rank]}, coordinator=coordinator)

    assert run_ranks(2, body) == [("ok", 10), ("ok", 10)]
    reads0, reads1 = (sorted(reads) for _, reads in ranks)
    assert reads0 == sorted(["chief.bin", STATE_NAME, ".metadata", "__0_0.distcp"])
    assert reads1 == sorted(["chief.bin", STATE_NAME, "__1_0.distcp"])
    assert models[0].loaded == {"chief.bin": b"chief-file", "__0_0.distcp": shard_bytes(10, 0)}
    assert models[1].loaded == {"chief.bin": b"chief-file", "__1_0.distcp": shard_bytes(10, 1)}
    # every rank's reader still lists every file of the manifest
    assert models[0].names == models[1].names == sorted(
        ["chief.bin", STATE_NAME, ".metadata", "__0_0.distcp", "__1_0.distcp"])


def test_without_a_coordinator_every_file_is_verified(ckdir: str) -> None:
    sharded_save(CheckpointManager(ckdir), 10)
    ((manager, reads),) = rank_managers(ckdir)[1:]
    manager.restore({"model": ShardedModel(read_ranks=None)})
    assert sorted(reads) == sorted(["chief.bin", STATE_NAME, ".metadata", "__0_0.distcp", "__1_0.distcp"])


def test_a_rank_reading_another_ranks_file_fetches_and_verifies_it_once(ckdir: str) -> None:
    sharded_save(CheckpointManager(ckdir), 10)
    ranks = rank_managers(ckdir)
    models = [ShardedModel(read_ranks=(0, 1)), ShardedModel(read_ranks=(1, 0, 0))]

    def body(coordinator: ThreadCoordinator) -> int | None:
        manager, _ = ranks[coordinator.rank]
        return manager.restore({"model": models[coordinator.rank]}, coordinator=coordinator)

    assert run_ranks(2, body) == [("ok", 10), ("ok", 10)]
    for model in models:
        assert model.loaded["__0_0.distcp"] == shard_bytes(10, 0)
        assert model.loaded["__1_0.distcp"] == shard_bytes(10, 1)
    assert ranks[0][1].count("__1_0.distcp") == 1  # fetched on demand
    assert ranks[1][1].count("__0_0.distcp") == 1  # read twice, fetched once
    assert ranks[1][1].count(".metadata") == 0  # never asked for


def test_a_corrupt_file_left_to_another_rank_fails_when_fetched(ckdir: str) -> None:
    """Rank 0 verifies its share only; a corrupt rank-1 file it reads anyway is checked then."""
    sharded_save(CheckpointManager(ckdir), 10)
    manager = CheckpointManager(ckdir, writer=False)
    corrupt(ckdir, 10, shard_name(1))

    class Solo:  # rank 0 of 2, alone: its all_gather reports only itself
        rank, world_size, is_chief = 0, 2, True

        def broadcast(self, obj, src=0):
            return obj

        def all_gather(self, obj):
            return [obj, None]

    own = ShardedModel(read_ranks=(0,))
    assert manager.restore({"model": own}, step=10, coordinator=Solo()) == 10
    other = ShardedModel(read_ranks=(1,))
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp does not match"):
        manager.restore({"model": other}, step=10, coordinator=Solo())


def test_a_file_corrupt_on_one_rank_makes_every_rank_fall_back_alike(ckdir: str) -> None:
    writer = CheckpointManager(ckdir, max_to_keep=None)
    sharded_save(writer, 10)
    sharded_save(writer, 20)
    corrupt(ckdir, 20, shard_name(1))  # only rank 1 verifies it
    ranks = rank_managers(ckdir)
    models = [ShardedModel(read_ranks=(0,)), ShardedModel(read_ranks=(1,))]

    def body(coordinator: ThreadCoordinator) -> int | None:
        manager, _ = ranks[coordinator.rank]
        return manager.restore({"model": models[coordinator.rank]}, coordinator=coordinator)

    calls: list[list[str]] = []
    assert run_ranks(2, body, calls) == [("ok", 10), ("ok", 10)]
    assert [m.loads for m in models] == [[(10, {"ranks": [0, 1]})]] * 2
    # the list of steps, then one agreement per checkpoint tried (20, then 10), on both ranks
    assert calls == [["broadcast", "all_gather", "all_gather"]] * 2
    assert "__1_0.distcp" not in ranks[0][1]  # rank 0 never verified rank 1's file
    # the chief (the writer) moved the corrupt checkpoint aside; rank 1 (a reader) did not try to
    assert writer.steps() == [10] and len(writer.quarantined()) == 1


def test_an_explicit_corrupt_step_raises_on_every_rank_and_restores_nothing(ckdir: str) -> None:
    writer = CheckpointManager(ckdir, max_to_keep=None)
    sharded_save(writer, 10)
    sharded_save(writer, 20)
    corrupt(ckdir, 20, shard_name(1))
    ranks = rank_managers(ckdir)
    models = [ShardedModel(read_ranks=(0,)), ShardedModel(read_ranks=(1,))]

    def body(coordinator: ThreadCoordinator) -> int | None:
        manager, _ = ranks[coordinator.rank]
        return manager.restore({"model": models[coordinator.rank]}, step=20, coordinator=coordinator)

    outcomes = run_ranks(2, body)
    assert [kind for kind, _ in outcomes] == ["raised", "raised"]
    errors = [error for _, error in outcomes]
    assert all(type(e) is CorruptCheckpointError for e in errors)
    assert errors[0].path == errors[1].path == writer.path(20)
    assert errors[0].reason == errors[1].reason and "__1_0.distcp" in errors[0].reason
    assert models[0].loads == models[1].loads == []
    assert writer.steps() == [10, 20]  # an explicit restore moves nothing aside


def test_a_collective_restore_uses_the_chiefs_list_of_checkpoints(ckdir: str, monkeypatch) -> None:
    """Rank 1 sees no checkpoint (e.g. a lagging listing): it still restores the chief's latest."""
    sharded_save(CheckpointManager(ckdir), 10)
    ranks = rank_managers(ckdir)
    monkeypatch.setattr(ranks[1][0], "steps", list)
    models = [ShardedModel(read_ranks=(0,)), ShardedModel(read_ranks=(1,))]

    def body(coordinator: ThreadCoordinator) -> int | None:
        manager, _ = ranks[coordinator.rank]
        return manager.restore({"model": models[coordinator.rank]}, coordinator=coordinator)

    assert run_ranks(2, body) == [("ok", 10), ("ok", 10)]


def test_a_collective_restore_of_nothing_returns_none_on_every_rank(ckdir: str) -> None:
    ranks = rank_managers(ckdir)

    def body(coordinator: ThreadCoordinator) -> int | None:
        return ranks[coordinator.rank][0].restore({"model": ShardedModel()}, coordinator=coordinator)

    assert run_ranks(2, body) == [("ok", None), ("ok", None)]


# == 4. VerifiedReader ============================================================================


def test_verified_reader_names_lists_the_verified_and_the_listed_files_sorted() -> None:
    reader = VerifiedReader(1, "ckpt-1", {"z.bin": b"z", "a.bin": b"a"}, listed=["m.bin", "a.bin"])
    assert reader.names() == ["a.bin", "m.bin", "z.bin"]
    assert VerifiedReader(1, "ckpt-1", {"b": b"1", "a": b"2"}).names() == ["a", "b"]


def test_verified_reader_fetches_a_listed_file_once_and_caches_it() -> None:
    fetched: list[str] = []

    def fetch(name: str) -> memoryview:
        fetched.append(name)
        return memoryview(f"fetched {name}".encode())

    reader = VerifiedReader(2, "ckpt-2", {"own.bin": b"own"}, listed=["own.bin", "other.bin"], fetch=fetch,
                            storage_options={"anon": True})
    assert reader.read("own.bin") == b"own" and fetched == []
    assert reader.read("other.bin") == b"fetched other.bin"
    assert bytes(reader.view("other.bin")) == b"fetched other.bin"
    assert fetched == ["other.bin"]
    assert reader.storage_options == {"anon": True}
    with pytest.raises(CheckpointError, match="has no file 'missing.bin'"):
        reader.view("missing.bin")
    assert fetched == ["other.bin"]  # not listed: never fetched


def test_verified_reader_without_fetch_refuses_a_listed_file_it_does_not_hold() -> None:
    reader = VerifiedReader(2, "ckpt-2", {"own.bin": b"own"}, listed=["other.bin"])
    assert reader.names() == ["other.bin", "own.bin"]
    with pytest.raises(CheckpointError, match="other.bin"):
        reader.read("other.bin")


def test_verified_reader_does_not_cache_a_failed_fetch() -> None:
    calls: list[str] = []

    def fetch(name: str) -> memoryview:
        calls.append(name)
        raise CorruptCheckpointError("ckpt-3", f"{name} does not match")

    reader = VerifiedReader(3, "ckpt-3", {}, listed=["x"], fetch=fetch)
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError):
            reader.view("x")
    assert calls == ["x", "x"]


def test_verify_all_shares_the_tagged_files_by_rank_modulo_the_world_size(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    files = {}
    for name in ("state.json", "r0", "r1", "r2", "r3"):
        data = name.encode() * 3
        (tmp_path / name).write_bytes(data)
        files[name] = (len(data), digest(data))
    document = manifest_lib.build(1, files, ranks={"r0": 0, "r1": 1, "r2": 2, "r3": 3})
    share = {rank: sorted(manifest_lib.verify_all(storage, str(tmp_path), document, (rank, 2))) for rank in (0, 1)}
    assert share == {0: ["r0", "r2", "state.json"], 1: ["r1", "r3", "state.json"]}
    assert sorted(manifest_lib.verify_all(storage, str(tmp_path), document)) == sorted(files)


# == CheckpointSession: a sharded save over two "ranks" ==========================================


class FakeShards:
    """WritesShards: each rank writes its file into the target directory; the ranks gather what
    they wrote (as the torch trainer does), the chief's snapshot adds them all."""

    writes_shards = True

    def __init__(self, coordinator: ThreadCoordinator) -> None:
        self.coordinator = coordinator
        self.targets: list[ShardTarget] = []
        self.gathered: dict[int, dict[str, tuple[int, str]]] = {}
        self.waited = 0

    def write_shards(self, target: ShardTarget) -> None:
        self.targets.append(target)
        own = write_rank_files(target.directory, target.step, self.coordinator.rank)
        self.gathered = dict(enumerate(self.coordinator.all_gather(own)))

    def wait_for_shards(self) -> None:
        self.waited += 1


def test_fake_shards_is_a_writes_shards() -> None:
    assert isinstance(FakeShards(None), WritesShards)  # type: ignore[arg-type]


def test_a_session_save_has_every_rank_write_into_the_chiefs_directory(ckdir: str) -> None:
    managers = [CheckpointManager(ckdir), CheckpointManager(ckdir, writer=False)]
    shards: list[FakeShards] = []
    saved: list[str] = []

    def body(coordinator: ThreadCoordinator) -> list[str | None]:
        fake = FakeShards(coordinator)
        shards.append(fake)
        session = CheckpointSession(managers[coordinator.rank], coordinator, on_save=saved.append,
                                    on_load=lambda path: None, shards=fake)
        paths = []
        for _ in range(2):  # the second save of the step writes nothing
            paths.append(session.save(11, lambda: {"model": ShardedModel(fake.gathered)}, prepare=lambda: None))
        session.close()
        return paths

    outcomes = run_ranks(2, body)
    path = managers[0].path(11)
    assert outcomes == [("ok", [path, path]), ("ok", [path, path])]
    assert saved == [path]
    for fake in shards:
        assert len(fake.targets) == 1 and fake.waited == 1  # the step already committed: no second target
        target = fake.targets[0]
        assert target.step == 11 and target.algorithm == ALGORITHM and not target.background
        assert Path(target.directory).name.startswith("ckpt-11.tmp-")
    assert shards[0].targets == shards[1].targets
    files = managers[0].manifest(11)["files"]
    assert files["__1_0.distcp"]["rank"] == 1 and files["__0_0.distcp"]["rank"] == 0
    assert leftovers(ckdir) == []
    reader, _ = managers[1].read(11)
    assert reader.read("__1_0.distcp") == shard_bytes(11, 1)
