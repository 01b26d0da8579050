"""Issue 39 (data loss): an export replaces only what cadence wrote. The target of an export must be absent,
an empty directory, or a cadence export (its marker, ``.cadence-export.json``, lists its files; one written
before the marker is known by its ``metadata.json``); anything else -- a file, a link, a directory holding a
file cadence did not write -- is refused before anything is created, and again at publishing, and nothing
is deleted. On local disks and on a ``memory://`` store; retention (``ExportFileManager(exports_only=True)``)
deletes only cadence's exports."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import fsspec
import pytest
import torch
from torch import nn

from cadence.actions import ExportFileManager
from cadence.export_marker import MARKER_FILE, ExportTargetError, refusal
from cadence.storage import Storage
from cadence.torch import ExportSignature, export_model, load_exported
from cadence.torch.export.api import read_export_metadata
from cadence.torch.export.signatures import export_model_signatures
from cadence.torch.export.staging import stage_and_publish

CHOOSE = "choose an empty or new directory"


def linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def files_of(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (``root`` included when it is a file or a link): files by their bytes,
    links by their target, directories as ``"dir"``."""
    def one(p: Path) -> bytes | str:
        return f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()

    if root.is_symlink() or root.is_file():
        return {".": one(root)}
    return {str(p.relative_to(root)): one(p) for p in sorted(root.rglob("*"))}


def user_project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "README").write_text("my project\n")
    (root / "src" / "notes.txt").write_text("notes\n")
    return root


# -- the rule ------------------------------------------------------------------------------------


def test_what_may_be_replaced_and_why_not(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    assert refusal(storage, str(tmp_path / "absent")) is None
    (tmp_path / "empty").mkdir()
    assert refusal(storage, str(tmp_path / "empty")) is None
    (tmp_path / "file").write_text("x")
    assert refusal(storage, str(tmp_path / "file")) == "exists and is a file, not a cadence export"
    os.symlink(tmp_path / "empty", tmp_path / "link")
    assert refusal(storage, str(tmp_path / "link")) == "is a symbolic link, not a cadence export"
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert refusal(storage, str(tmp_path / "dangling")) == "is a symbolic link, not a cadence export"
    user_project(tmp_path / "project")
    assert refusal(storage, str(tmp_path / "project")) == "exists and is not a cadence export (holds README)"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metadata.json").write_text('{"files": ["metadata.json"]}')  # not cadence's keys
    assert refusal(storage, str(tmp_path / "other")) == "exists and is not a cadence export (holds metadata.json)"
    (tmp_path / "bad-marker").mkdir()
    (tmp_path / "bad-marker" / MARKER_FILE).write_text('{"format": "cadence-export", "files": ["../x"]}')
    assert "is not a cadence export" in refusal(storage, str(tmp_path / "bad-marker"))


def test_a_user_directory_file_or_link_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    targets = {"dir": user_project(tmp_path / "project"), "file": tmp_path / "notes.txt"}
    targets["file"].write_text("mine")
    targets["link"] = tmp_path / "link"
    os.symlink(targets["dir"], targets["link"])
    why = {"dir": "exists and is not a cadence export (holds README)",
           "file": "exists and is a file, not a cadence export", "link": "is a symbolic link, not a cadence export"}
    before = files_of(tmp_path)
    for kind, target in targets.items():
        with pytest.raises(ExportTargetError) as caught:
            export_model(linear(), str(target), ["safetensors", "torchscript"], example_inputs=(torch.zeros(2, 4),))
        assert str(caught.value) == f"export directory {target}: {why[kind]}; {CHOOSE}"
        assert caught.value.exit_code == 2
        assert files_of(tmp_path) == before  # nothing deleted, nothing added (no temp sibling)
    with pytest.raises(ExportTargetError):  # the check comes before the stage is made
        with stage_and_publish(Storage(str(targets["dir"]))):
            raise AssertionError("the export ran")


def test_an_export_replaces_cadences_own_export_and_an_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    export_model(linear(1), str(out), ["safetensors", "torchscript"], example_inputs=(torch.zeros(2, 4),),
                 metadata={"run": "first"})
    assert sorted(os.listdir(out)) == [MARKER_FILE, "metadata.json", "model.safetensors", "model.torchscript.pt"]
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker == {"format": "cadence-export", "version": 1,
                      "files": ["metadata.json", "model.safetensors", "model.torchscript.pt"]}
    export_model(linear(2), str(out), "safetensors", metadata={"run": "second"})
    assert sorted(os.listdir(out)) == [MARKER_FILE, "metadata.json", "model.safetensors"]  # torchscript gone
    assert read_export_metadata(str(out))["run"] == "second"
    assert torch.equal(load_exported(str(out), "safetensors")["weight"], linear(2).weight)
    assert os.listdir(tmp_path) == ["out"]  # no temp dir, no old export left aside


def test_a_file_added_to_an_export_makes_it_the_users(tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_model(linear(), str(out), "safetensors")
    (out / "notes.txt").write_text("mine")
    before = files_of(tmp_path)
    with pytest.raises(ExportTargetError, match=rf"export directory {out}: is a cadence export that also holds "
                                                rf"notes.txt, which cadence did not write; {CHOOSE}$"):
        export_model(linear(1), str(out), "safetensors")
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()  # an empty directory of the user's
    with pytest.raises(ExportTargetError, match="also holds sub, which cadence did not write"):
        export_model(linear(1), str(out), "safetensors")
    os.rmdir(out / "sub")
    (out / "model.safetensors").unlink()  # fewer files than the marker lists: still cadence's
    export_model(linear(1), str(out), "safetensors")
    assert (out / "model.safetensors").is_file() and files_of(tmp_path) != before


def test_exports_written_before_the_marker_are_known_by_their_metadata(tmp_path: Path) -> None:
    out = tmp_path / "old"
    export_model(linear(), str(out), ["safetensors", "torchscript"], example_inputs=(torch.zeros(2, 4),))
    (out / MARKER_FILE).unlink()  # as cadence wrote it before the marker
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportTargetError, match="also holds notes.txt"):
        export_model(linear(1), str(out), "safetensors")
    (out / "notes.txt").unlink()
    export_model(linear(1), str(out), "safetensors")
    assert sorted(os.listdir(out)) == [MARKER_FILE, "metadata.json", "model.safetensors"]

    signed = tmp_path / "signed"  # with signatures: signatures.json and each signature's metadata.json
    x = torch.zeros(2, 4)
    model = linear()
    export_model_signatures({"a": ExportSignature(model, (x,)), "b": ExportSignature(lambda t: model(t) * 2, (x,))},
                            str(signed), "safetensors", model=model)
    marker = json.loads((signed / MARKER_FILE).read_text())
    assert marker["files"] == ["a/metadata.json", "a/model.safetensors", "b/metadata.json", "b/model.safetensors",
                               "signatures.json"]
    (signed / MARKER_FILE).unlink()
    (signed / "a" / "extra.bin").write_bytes(b"mine")
    with pytest.raises(ExportTargetError, match="also holds a/extra.bin"):
        export_model(linear(1), str(signed), "safetensors")
    (signed / "a" / "extra.bin").unlink()
    export_model(linear(1), str(signed), "safetensors")  # the signature dirs go too
    assert sorted(os.listdir(signed)) == [MARKER_FILE, "metadata.json", "model.safetensors"]


# -- publishing: checked again -------------------------------------------------------------------


@pytest.mark.parametrize("before", ["absent", "empty", "export"])
def test_something_that_appears_while_an_export_is_written_is_never_deleted(tmp_path: Path, before: str) -> None:
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    if before == "export":
        export_model(linear(), str(out), "safetensors")
    with pytest.raises(ExportTargetError, match=rf"export directory {out}: "):
        with stage_and_publish(Storage(str(out))) as stage:
            Path(stage, "model.safetensors").write_bytes(b"new")
            out.mkdir(exist_ok=True)
            (out / "late.txt").write_text("the user's")  # while the export is written
    assert (out / "late.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the stage removed, nothing left aside
    if before == "export":
        assert sorted(read_export_metadata(str(out))["files"]) == ["metadata.json", "model.safetensors"]


# -- object stores -------------------------------------------------------------------------------


def test_a_memory_store_follows_the_same_rule(memdir: str) -> None:
    fs = fsspec.filesystem("memory")
    root = memdir.rsplit("/", 1)[0]
    fs.pipe(f"{root}/project/README", b"mine")
    fs.pipe(f"{root}/project/src/notes.txt", b"notes")
    fs.pipe(f"{root}/afile", b"x")
    for target, why in (("project", "exists and is not a cadence export (holds README)"),
                        ("afile", "exists and is a file, not a cadence export")):
        with pytest.raises(ExportTargetError, match=re.escape(f"/{target}: {why}; {CHOOSE}")):
            export_model(linear(), f"{root}/{target}", "safetensors")
    assert fs.cat(f"{root}/project/README") == b"mine" and fs.cat(f"{root}/project/src/notes.txt") == b"notes"
    assert fs.cat(f"{root}/afile") == b"x"
    assert sorted(fs.find(root)) == [f"{fs._strip_protocol(root)}/{n}" for n in ("afile", "project/README",
                                                                                  "project/src/notes.txt")]

    out = f"{root}/export"
    export_model(linear(1), out, ["safetensors", "torchscript"], example_inputs=(torch.zeros(2, 4),))
    assert sorted(fs.ls(out, detail=False)) == [f"{fs._strip_protocol(out)}/{n}" for n in (
        MARKER_FILE, "metadata.json", "model.safetensors", "model.torchscript.pt")]
    fs.rm(f"{out}/metadata.json")  # an upload cut short: the marker (uploaded first) still says it is cadence's
    export_model(linear(2), out, "safetensors")
    assert sorted(fs.ls(out, detail=False)) == [f"{fs._strip_protocol(out)}/{n}" for n in (
        MARKER_FILE, "metadata.json", "model.safetensors")]
    assert torch.equal(load_exported(out, "safetensors")["weight"], linear(2).weight)
    fs.pipe(f"{out}/notes.txt", b"mine")
    with pytest.raises(ExportTargetError, match="also holds notes.txt, which cadence did not write"):
        export_model(linear(3), out, "safetensors")
    assert fs.cat(f"{out}/notes.txt") == b"mine" and sorted(read_export_metadata(out)["files"]) == [
        "metadata.json", "model.safetensors"]


# -- retention -----------------------------------------------------------------------------------


def test_retention_deletes_only_cadences_exports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = tmp_path / "export" / "best"
    for step in (100, 200, 300):
        export_model(linear(step), str(base / str(step)), "safetensors")
    user_project(base / "50")  # the user's directory, in a member's place
    (base / "60").mkdir()  # an empty one: nothing to lose
    (base / "70").write_text("a file")
    os.symlink(base / "50", base / "80")
    (base / "200" / "notes.txt").write_text("mine")  # added to an export of cadence's
    user_files = {p: files_of(base / p) for p in ("50", "70", "80")}
    manager = ExportFileManager(str(base), max_to_keep=1, separator="/", exports_only=True)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        assert manager.clean_up() == [str(base / "60"), str(base / "100")]
    assert sorted(os.listdir(base)) == ["200", "300", "50", "70", "80"]
    assert {p: files_of(base / p) for p in ("50", "70", "80")} == user_files
    assert sorted(os.listdir(base / "200")) == [MARKER_FILE, "metadata.json", "model.safetensors", "notes.txt"]
    for step, why in (("50", "exists and is not a cadence export (holds README)"),
                      ("70", "exists and is a file, not a cadence export"),
                      ("80", "is a symbolic link, not a cadence export"),
                      ("200", "is a cadence export that also holds notes.txt, which cadence did not write")):
        assert f"not deleting old export {base}/{step}: it {why}" in caplog.text

    memory = f"memory://retention-{os.getpid()}-{id(caplog)}/export"
    fs = fsspec.filesystem("memory")
    for step in (1, 2):
        export_model(linear(step), f"{memory}/{step}", "safetensors")
    fs.pipe(f"{memory}/0/README", b"mine")
    assert ExportFileManager(memory, max_to_keep=1, separator="/", exports_only=True).clean_up() == [f"{memory}/1"]
    assert fs.cat(f"{memory}/0/README") == b"mine" and not fs.find(f"{memory}/1")
    fs.rm(memory.rsplit("/", 1)[0], recursive=True)
