"""Issue 12, item 3: symbolic links never lead a reader or a deletion out of the model dir.

A checkpoint holding a link (the ``ckpt-N`` dir itself, a file in it, or its manifest) is refused
as corrupt, naming the link: skipped on resume (the previous checkpoint is restored), raised for an
explicit step, marked by ``cadence ls --verify``. Deleting one (retention, ``delete``, clean-up,
export clean-up) removes the link, never what it points to. Real links on a local disk, and the
CLI run as a user runs it. The outside files are byte-for-byte copies that match the manifest, so
only the link check can tell them apart.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from functools import partial
from pathlib import Path

import pytest
import yaml

from cadence.actions import ExportFileManager
from cadence.checkpoint import CheckpointManager, Storage
from cadence.errors import CorruptCheckpointError
from cli_run import run_cadence

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
# COLUMNS: rich writes each message and table cell on one line, so a path is never cut in two.


class Blob:
    """Checkpointable: writes ``files``; remembers what it loaded and from which step."""

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files = dict(files or {})
        self.step: int | None = None

    def save_checkpoint(self, writer):
        for name, data in self.files.items():
            writer.write(name, data)
        return None

    def load_checkpoint(self, reader, state):
        self.files = {name: reader.read(name) for name in reader.names() if name != "state.json"}
        self.step = reader.step


def save(manager: CheckpointManager, step: int) -> None:
    manager.save(step, {"model": Blob({"model.safetensors": f"weights-{step}".encode() * 8})})


def link_to_copy(path: Path, outside: Path) -> Path:
    """Replace ``path`` (a file or a dir) by a link to an identical copy at ``outside``."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(path, outside)
    path.symlink_to(outside, target_is_directory=outside.is_dir())
    return outside


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    return tmp_path / "model" / "checkpoints"


# -- reading -----------------------------------------------------------------------------------

LINKED = {  # what in ckpt-20/ is replaced by a link (None: ckpt-20/ itself)
    "model file": "model.safetensors",
    "state.json": "state.json",
    "manifest": "MANIFEST.json",
    "checkpoint dir": None,
}


@pytest.mark.parametrize("kind", sorted(LINKED))
def test_a_checkpoint_holding_a_link_is_refused_and_restore_falls_back(
    ckdir: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CheckpointManager(str(ckdir), max_to_keep=None)
    save(writer, 10)
    save(writer, 20)
    name = LINKED[kind]
    linked = ckdir / "ckpt-20" if name is None else ckdir / "ckpt-20" / name
    link_to_copy(linked, tmp_path / "elsewhere" / linked.name)

    reader = CheckpointManager(str(ckdir), writer=False)
    assert reader.steps() == [10, 20]  # listed (cheap), refused when read
    blob = Blob()
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        assert reader.restore({"model": blob}) == 10
    assert blob.step == 10 and blob.files["model.safetensors"] == b"weights-10" * 8
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{linked} is a symbolic link" in warning

    untouched = Blob()
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        reader.restore({"model": untouched}, step=20)
    assert str(linked) in str(info.value) and info.value.path == str(ckdir / "ckpt-20")
    assert untouched.step is None
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        reader.read(20)


def test_a_resuming_writer_moves_the_link_aside_and_saves_the_step_anew(ckdir: Path, tmp_path: Path) -> None:
    writer = CheckpointManager(str(ckdir), max_to_keep=None)
    save(writer, 10)
    save(writer, 20)
    outside = link_to_copy(ckdir / "ckpt-20", tmp_path / "elsewhere" / "ckpt-20")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}

    resumed = CheckpointManager(str(ckdir), max_to_keep=1)
    assert resumed.restore({"model": Blob()}) == 10
    [aside] = resumed.quarantined()
    assert (ckdir / aside).is_symlink()  # the link was moved, not its target
    save(resumed, 20)
    assert not (ckdir / "ckpt-20").is_symlink() and resumed.steps() == [20]
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


# -- deleting ----------------------------------------------------------------------------------


def outside_tree(tmp_path: Path) -> dict[Path, bytes]:
    """Precious files outside the model dir: ``{path: bytes}``."""
    files = {tmp_path / "elsewhere" / "precious.txt": b"keep me",
             tmp_path / "elsewhere" / "MANIFEST.json": b"{}",
             tmp_path / "elsewhere-file.bin": b"keep me too"}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def assert_intact(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        assert path.read_bytes() == data, f"{path} was changed or deleted"


def test_retention_delete_and_clean_up_remove_links_never_their_targets(ckdir: Path, tmp_path: Path) -> None:
    writer = CheckpointManager(str(ckdir), max_to_keep=None)
    for step in (10, 20, 30):
        save(writer, step)
    precious = outside_tree(tmp_path)
    for step in (10, 20):  # committed checkpoints moved out of the model dir, linked back
        link_to_copy(ckdir / f"ckpt-{step}", tmp_path / f"moved-{step}")
        precious.update({p: p.read_bytes() for p in (tmp_path / f"moved-{step}").iterdir()})
    (ckdir / "ckpt-30" / "extra").symlink_to(tmp_path / "elsewhere-file.bin")  # a link inside a checkpoint
    (ckdir / "ckpt-40.tmp-abc123").symlink_to(tmp_path / "elsewhere")  # "leftovers" of a crashed save
    (ckdir / "ckpt-50").symlink_to(tmp_path / "elsewhere")  # its MANIFEST.json is not a checkpoint's
    (ckdir / "ckpt-60").symlink_to(tmp_path / "nowhere")

    writer = CheckpointManager(str(ckdir), max_to_keep=1)  # start-up clean-up, then retention on save
    assert not os.path.lexists(ckdir / "ckpt-40.tmp-abc123") and not os.path.lexists(ckdir / "ckpt-60")
    writer.delete(10)  # explicit
    assert not os.path.lexists(ckdir / "ckpt-10")
    assert_intact(precious)
    save(writer, 70)  # retention deletes 20 (a link), 30 (holds a link) and 50 (a link)
    assert writer.steps() == [70]
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("ckpt")) == ["ckpt-70"]
    assert_intact(precious)


def test_storage_refuses_to_delete_through_a_link_and_removes_links_alone(tmp_path: Path) -> None:
    precious = outside_tree(tmp_path)
    root = tmp_path / "model"
    (root / "real").mkdir(parents=True)
    (root / "real" / "dir-link").symlink_to(tmp_path / "elsewhere")
    (root / "file-link").symlink_to(tmp_path / "elsewhere-file.bin")
    storage = Storage(str(root))
    assert storage.link_under(storage.join("real", "dir-link", "precious.txt")) == str(root / "real" / "dir-link")
    assert storage.link_under(storage.join("real")) is None and storage.link_under(storage.root) is None
    with pytest.raises(OSError, match="dir-link is a symbolic link"):
        storage.remove(storage.join("real", "dir-link", "precious.txt"))
    with pytest.raises(OSError, match="dir-link is a symbolic link"):
        storage.rmtree(storage.join("real", "dir-link", "sub"))
    storage.rmtree(storage.join("real", "dir-link"))
    storage.remove(storage.join("file-link"))
    assert sorted(os.listdir(root)) == ["real"] and os.listdir(root / "real") == []
    assert_intact(precious)
    memory = Storage(f"memory://cadence-links-{uuid.uuid4().hex}/m")  # no links off local disks
    assert memory.link_under(memory.join("a", "b")) is None


def test_export_clean_up_never_deletes_below_a_link(tmp_path: Path) -> None:
    precious = outside_tree(tmp_path)
    (tmp_path / "elsewhere" / "saved_model").mkdir()
    (tmp_path / "elsewhere" / "saved_model" / "model.bin").write_bytes(b"outside")
    precious[tmp_path / "elsewhere" / "saved_model" / "model.bin"] = b"outside"
    base = tmp_path / "exports" / "export"
    base.parent.mkdir()
    (tmp_path / "exports" / "export-0").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "exports" / "export-1").mkdir()
    (tmp_path / "exports" / "export-1" / "saved_model").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "exports" / "export-2" / "saved_model").mkdir(parents=True)
    manager = ExportFileManager(str(base), max_to_keep=1, subdirectory="saved_model")
    assert manager.clean_up() == [f"{base}-1/saved_model"]  # export-0 is kept: its saved_model is outside
    assert not os.path.lexists(tmp_path / "exports" / "export-1" / "saved_model")
    assert_intact(precious)


# -- through the CLI, as a user runs it ----------------------------------------------------------


cadence = partial(run_cadence, env={"COLUMNS": "1000"})  # the CLI runner, no line wrapped


def test_cli_never_reads_a_linked_model_file(tmp_path: Path) -> None:
    cfg = {"task": {"class": TASK, "params": {}},
           "trainer": {"train_steps": 40, "steps_per_loop": 5, "checkpoint_interval": 10,
                       "validation_interval": 20, "max_to_keep": 3, "seed": 3}}
    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(cfg))
    trained = cadence("train", str(config), "--model-dir", str(run), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    weights = run / "checkpoints" / "ckpt-40" / "model.safetensors"
    crafted = tmp_path / "crafted" / "model.safetensors"  # matches the manifest byte for byte
    link_to_copy(weights, crafted)
    data = crafted.read_bytes()
    named = f"{weights} is a symbolic link"

    listed = cadence("ls", str(run), "--verify")
    assert listed.returncode == 1 and "CORRUPT" in listed.stdout and named in listed.stdout, listed.stdout

    evaluated = cadence("evaluate", str(config), "--model-dir", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout.splitlines()[-1])["step"] == 30  # fell back
    assert named in evaluated.stderr

    explicit = cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "40")
    assert explicit.returncode != 0 and named in explicit.stderr and "Traceback" not in explicit.stderr

    exported = cadence("export", str(run), "--checkpoint", "latest", "--format", "safetensors")
    assert exported.returncode == 0, exported.stderr
    assert "exported step 30" in exported.stderr and named in exported.stderr
    assert (run / "export" / "checkpoint" / "30" / "model.safetensors").exists()

    resumed = cadence("train", str(config), "--model-dir", str(run), "--no-progress", "--set", "trainer.train_steps=50")
    assert resumed.returncode == 0, resumed.stderr
    assert "skipping checkpoint" in resumed.stderr and named in resumed.stderr
    assert not weights.is_symlink() and weights.exists()  # step 40 retrained from 30 and saved anew
    assert crafted.read_bytes() == data  # the outside file is untouched
    assert cadence("ls", str(run), "--verify").returncode == 0


def test_a_link_swapped_in_after_the_check_is_not_followed(tmp_path):
    """The read itself refuses a link (O_NOFOLLOW): a link put in place between the check and the
    open is not followed either."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    link = tmp_path / "m" / "file.bin"
    link.parent.mkdir()
    link.symlink_to(outside)
    storage = Storage(str(tmp_path / "m"))
    assert storage.read_view(str(link)) == b"secret"  # an ordinary read follows it
    with pytest.raises(OSError):
        storage.read_view(str(link), follow_link=False)
