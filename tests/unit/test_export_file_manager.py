"""ExportFileManager's ``subdirectory`` option (Orbit's): members are ``base-<id>/<subdirectory>``,
and clean-up deletes only those subdirectories. Local disk and an fsspec memory:// store."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from cadence.actions import ExportFileManager


def test_names_members_and_clean_up_with_a_subdirectory(tmp_path: Path) -> None:
    base = str(tmp_path / "export")
    manager = ExportFileManager(base, max_to_keep=2, subdirectory="saved_model")
    names = []
    for _ in range(3):
        name = manager.next_name()
        Path(name).mkdir(parents=True)
        (Path(name) / "model.bin").write_bytes(b"x")
        (Path(name).parent / "metadata.json").write_text("{}")  # a sibling of the managed subdirectory
        names.append(name)
    assert names == [f"{base}-{i}/saved_model" for i in range(3)]
    assert manager.managed_files == names
    assert manager.clean_up() == [f"{base}-0/saved_model"]
    assert not Path(names[0]).exists()
    assert (tmp_path / "export-0" / "metadata.json").exists()  # only the subdirectory was deleted
    assert manager.managed_files == names[1:]


def test_only_ids_holding_the_subdirectory_count_and_numbering_resumes(tmp_path: Path) -> None:
    base = str(tmp_path / "export")
    (tmp_path / "export-4" / "saved_model").mkdir(parents=True)
    (tmp_path / "export-9").mkdir()  # no subdirectory: not a member
    (tmp_path / "export-12" / "other").mkdir(parents=True)
    manager = ExportFileManager(base, subdirectory="saved_model/")
    assert manager.managed_ids == [4]
    assert manager.next_name() == f"{base}-5/saved_model"  # after the highest member
    assert ExportFileManager(base, max_to_keep=0, subdirectory="saved_model").clean_up() == [f"{base}-4/saved_model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export-12", "export-4", "export-9"]


def test_subdirectory_with_a_step_id_and_slash_separator_on_an_fsspec_store() -> None:
    root = f"memory://efm-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    step = [0]
    manager = ExportFileManager(f"{root}/export", max_to_keep=1, next_id_fn=lambda: step[0], separator="/",
                                subdirectory="onnx")
    for step[0] in (100, 200):
        name = manager.next_name()
        fs.pipe(f"{name}/model.onnx", b"x")
        fs.pipe(name.rsplit("/", 1)[0] + "/keep.txt", b"y")
    assert manager.managed_files == [f"{root}/export/100/onnx", f"{root}/export/200/onnx"]
    assert manager.clean_up() == [f"{root}/export/100/onnx"]
    assert not fs.exists(f"{root}/export/100/onnx/model.onnx")
    assert fs.exists(f"{root}/export/100/keep.txt")
    fs.rm(root, recursive=True)


def test_a_restarted_manager_resumes_numbering_and_keeps_all_with_max_to_keep_none(tmp_path: Path) -> None:
    base = str(tmp_path / "export")
    first = ExportFileManager(base, max_to_keep=None, subdirectory="saved_model")
    for _ in range(3):
        Path(first.next_name()).mkdir(parents=True)
    assert first.clean_up() == []  # None: everything is kept
    restarted = ExportFileManager(base, max_to_keep=None, subdirectory="saved_model")  # a new process
    assert restarted.managed_ids == [0, 1, 2]
    assert restarted.next_name() == f"{base}-3/saved_model"
    assert restarted.next_name() == f"{base}-4/saved_model"  # not repeated before it is written
    assert restarted.clean_up() == []
    assert len(restarted.managed_files) == 3


def test_a_nested_subdirectory_is_deleted_alone(tmp_path: Path) -> None:
    base = str(tmp_path / "export")
    manager = ExportFileManager(base, max_to_keep=1, subdirectory="./models//onnx/")
    assert manager.subdirectory == "models/onnx"  # normalised
    for _ in range(2):
        name = Path(manager.next_name())
        name.mkdir(parents=True)
        (name.parent / "notes.txt").write_text("kept")
    assert manager.clean_up() == [f"{base}-0/models/onnx"]
    assert sorted(p.name for p in (tmp_path / "export-0").rglob("*")) == ["models", "notes.txt"]


@pytest.mark.parametrize("bad", ["", "/", ".", "/abs", "..", "../outside", "a/../../b", 3])
def test_a_subdirectory_must_be_a_relative_path_inside_the_member(tmp_path: Path, bad) -> None:
    """Nothing outside base-<id>/ can become a member, so clean_up never deletes there."""
    with pytest.raises(ValueError, match="subdirectory must be a relative path"):
        ExportFileManager(str(tmp_path / "e"), subdirectory=bad)
