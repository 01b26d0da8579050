"""What a refused training run takes back (:mod:`cadence.checkpoint.footprint`) and the writer lease's
withdrawal, with the real lease, checkpoint manager and files (no torch). The CLI's refusals:
tests/processes/test_refused_runs.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fsspec
import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.footprint import ModelDirFootprint, check_training_paths, is_refusal
from cadence.checkpoint.writer_lease import WriterLease, current_lease, take_over
from cadence.errors import CheckpointError, ConfigError, SanityCheckError, TrainStepOutputError


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def start(model_dir: str) -> tuple[ModelDirFootprint, WriterLease]:
    """What build_run does: the footprint, the lease, then the rest of the footprint."""
    footprint = ModelDirFootprint(model_dir)
    lease = WriterLease.acquire(model_dir, ttl=30)
    footprint.held()
    return footprint, lease


def write_as_a_run_does(model_dir: Path) -> None:
    CheckpointManager(str(model_dir / "checkpoints"))  # creates checkpoints/
    CheckpointManager(str(model_dir / "best"))  # the best checkpoint's manager, on every rank
    (model_dir / "config.yaml").write_text("task: new\n")


def test_bad_input_is_exit_status_2():
    assert all(is_refusal(e) for e in (ConfigError("x"), SanityCheckError("x"), TrainStepOutputError("x")))
    assert not any(is_refusal(e) for e in (CheckpointError("x"), RuntimeError("x"), KeyboardInterrupt(), None))


def test_a_fresh_run_takes_everything_back(tmp_path):
    run = tmp_path / "deep" / "run"
    footprint, lease = start(str(run))
    write_as_a_run_does(run)
    assert {"config.yaml", "checkpoints", "best", ".writer/lease-000000000001.json"} <= set(tree(run))
    footprint.undo(lease)
    assert not run.exists() and (tmp_path / "deep").is_dir()  # only what it created
    assert footprint.undo(lease) == []  # idempotent
    lease.release()  # a no-op once withdrawn: no file comes back
    assert not run.exists()


def test_what_another_process_wrote_stays_and_so_do_the_dirs_holding_it(tmp_path):
    run = tmp_path / "run"
    footprint, lease = start(str(run))
    write_as_a_run_does(run)
    sidecar = run / "checkpoints" / ".leases" / "sidecar-eval.json"  # a sidecar started beside it
    sidecar.parent.mkdir()
    sidecar.write_text("{}")
    footprint.undo(lease)
    assert tree(run) == {"checkpoints": "dir", "checkpoints/.leases": "dir",
                         "checkpoints/.leases/sidecar-eval.json": hashlib.sha256(b"{}").hexdigest()}


def test_a_resumed_run_leaves_every_file_as_it_was(tmp_path):
    run = tmp_path / "run"
    for _ in range(2):  # two earlier runs: lease files 1 and 2, both released
        WriterLease.acquire(str(run)).release()
    write_as_a_run_does(run)
    (run / "checkpoints" / "FINAL").write_text('{"step": 8}')
    (run / "train").mkdir()
    (run / "train" / "metrics.jsonl").write_text('{"step": 8}\n')
    before = tree(run)
    footprint, lease = start(str(run))
    assert lease.token == 3
    (run / "config.yaml").write_text("task: changed\n")  # written over
    (run / "checkpoints" / "FINAL").unlink()  # cleared to train past it
    (run / "best" / "best.json").write_text("{}")  # not there before
    (run / "eval").mkdir()
    footprint.undo(lease)
    assert tree(run) == before  # the older lease files too: none is pruned by the refused run
    assert WriterLease.acquire(str(run)).token == 3  # the current lease is the one before again


def test_a_newer_lease_keeps_the_withdrawn_file_released(tmp_path):
    """Taken over meanwhile (--take-over): the file is history, released, not removed."""
    run = str(tmp_path / "run")
    footprint, lease = start(run)
    taken = take_over(run)
    assert taken is not None and taken.token == 1
    footprint.undo(lease)
    assert sorted(p.name for p in (tmp_path / "run" / ".writer").iterdir()) == [
        "lease-000000000001.json", "lease-000000000002.json"]
    record = current_lease(run)
    assert record is not None and record.token == 2 and record.released


def test_release_prunes_the_files_before_the_previous_lease(tmp_path):
    run = tmp_path / "run"
    for _ in range(3):
        WriterLease.acquire(str(run)).release()
    lease = WriterLease.acquire(str(run))
    assert sorted(p.name for p in (run / ".writer").iterdir())[0] == "lease-000000000002.json"  # not pruned yet
    lease.release()
    assert sorted(p.name for p in (run / ".writer").iterdir()) == ["lease-000000000003.json",
                                                                  "lease-000000000004.json"]


def test_an_object_store_model_dir_is_taken_back_too(memdir):
    run = memdir.rsplit("/", 1)[0] + "/run"
    footprint, lease = start(run)
    fs, path = fsspec.core.url_to_fs(run)
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    fs.pipe_file(f"{path}/config.yaml", b"task: new\n")
    footprint.undo(lease)
    assert not fs.exists(path)


@pytest.mark.parametrize("name", [".writer", "checkpoints", "best", "train", "eval"])
def test_a_training_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path, name):
    (tmp_path / name).write_text("x")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / name} is a file, not a directory: a training run writes "):
        check_training_paths(str(tmp_path))
    (tmp_path / name).unlink()
    (tmp_path / "config.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"config\.yaml is a directory, not a file"):
        check_training_paths(str(tmp_path))
    (tmp_path / "config.yaml").rmdir()
    check_training_paths(str(tmp_path))  # all is well
    check_training_paths(str(tmp_path / "missing"))  # nothing yet: all is well
