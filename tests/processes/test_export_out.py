"""Issue 39 (data loss): ``cadence export --out`` as a user runs it writes only where nothing of the user's
is lost. A directory holding the user's files, a file or a link is refused (exit 2, one line, no traceback)
and left byte for byte as it was, nothing added beside it; cadence's own earlier export there is replaced."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cli_run import run_cadence as cadence

CHOOSE = "choose an empty or new directory"
MARKER = ".cadence-export.json"


def files_of(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: files by their bytes, links by their target, directories as ``"dir"``."""
    def one(p: Path) -> bytes | str:
        return f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(root)): one(p) for p in sorted(root.rglob("*"))}


def export(model_dir: Path, out: Path, *formats: str, checkpoint: str = "latest"):
    flags = [arg for fmt in formats for arg in ("--format", fmt)]
    return cadence("export", str(model_dir), "--checkpoint", checkpoint, *flags, "--out", str(out))


def test_export_out_refuses_what_cadence_did_not_write(digits_run, tmp_path: Path) -> None:
    model_dir, _ = digits_run
    project = tmp_path / "my-project"
    (project / "src").mkdir(parents=True)
    (project / "README").write_text("my project\n")
    (project / "src" / "notes.txt").write_text("notes\n")
    (tmp_path / "notes.txt").write_text("a file\n")
    os.symlink(project, tmp_path / "link")
    before = files_of(tmp_path)
    for name, why in (("my-project", "exists and is not a cadence export (holds README)"),
                      ("notes.txt", "exists and is a file, not a cadence export"),
                      ("link", "is a symbolic link, not a cadence export")):
        proc = export(model_dir, tmp_path / name, "safetensors")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == f"cadence: error: --out {tmp_path / name}: {why}; {CHOOSE}"
        assert proc.stdout == ""
        assert files_of(tmp_path) == before  # nothing deleted, changed or added (no temp or parent dir)


def test_export_out_replaces_cadences_own_export_only(digits_run, tmp_path: Path) -> None:
    model_dir, _ = digits_run
    out = tmp_path / "export"
    assert export(model_dir, out, "safetensors", "torchscript", checkpoint="400").returncode == 0
    assert sorted(os.listdir(out)) == [MARKER, "metadata.json", "model.safetensors", "model.torchscript.pt"]
    proc = export(model_dir, out, "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == [MARKER, "metadata.json", "model.safetensors"]  # replaced as a whole
    assert json.loads((out / "metadata.json").read_text())["step"] == 600
    assert os.listdir(tmp_path) == ["export"]

    (out / "notes.txt").write_text("mine\n")  # the user's file inside the old export: no longer cadence's alone
    before = files_of(tmp_path)
    proc = export(model_dir, out, "safetensors", checkpoint="400")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"cadence: error: --out {out}: is a cadence export that also holds notes.txt, "
                                   f"which cadence did not write; {CHOOSE}")
    assert files_of(tmp_path) == before
