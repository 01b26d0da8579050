"""Bad input the CLI refuses in one line (issue 39): a flag out of its range, a model dir that cannot be
one, a checkpoint that does not exist, a Task whose code fails at its first use. Each exits 2 (bad
input, nothing started: docs/design.md's "Exit codes") with exactly one line ``cadence: error: ...``
naming what is wrong, no traceback, and creates nothing."""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from cadence.cli.main import main
from configs import write_config

Refused = Callable[..., str]


def tree(top: Path) -> list[str]:
    """Every path under ``top``, a directory marked with a trailing slash."""
    return sorted(str(p.relative_to(top)) + "/" * p.is_dir() for p in top.rglob("*"))


@pytest.fixture
def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Refused:
    """``refused(*argv)``: runs ``cadence ARGV``, checks exit 2, one ``cadence: error:`` line, no
    traceback and ``tmp_path`` unchanged; returns the line's message."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # importing a Task file leaves no __pycache__

    def run(*argv: object) -> str:
        before = tree(tmp_path)
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("cadence: error: "), err
        assert tree(tmp_path) == before
        return err.strip().removeprefix("cadence: error: ")

    return run


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(tmp_path / "code")


# -- numeric flags: their bounds (cadence.cli.flags) or the config schema's, named by the flag -------------

SECONDS = "expected a number of seconds from 0 to 31622400"
FLAGS = [
    (["launch", "{cfg}", "--sidecar", "--model-dir", "{md}", "--grace", "-1"], f"--grace: {SECONDS}, got -1.0"),
    (["launch", "{cfg}", "--sidecar", "--model-dir", "{md}", "--grace", "nan"], f"--grace: {SECONDS}, got nan"),
    (["sweep", "{cfg}", "--space", "{md}", "--trials", "2", "--grace", "-1"], f"--grace: {SECONDS}, got -1.0"),
    (["sweep", "{cfg}", "--space", "{md}", "--trials", "2", "--grace", "inf"], f"--grace: {SECONDS}, got inf"),
    (["evaluate", "{cfg}", "--model-dir", "{md}", "--checkpoint", "-5"],
     "--checkpoint: expected best, latest or a step number >= 0, got '-5'"),
    (["export", "{md}", "--checkpoint", "BEST", "--format", "safetensors"],
     "--checkpoint: expected best, latest or a step number >= 0, got 'BEST'"),
    (["evaluate", "{cfg}", "--model-dir", "{md}", "--continuous", "--timeout", "-1"],
     "--timeout: sidecar.timeout: expected a number from 0 to 31622400 or null, got -1.0"),
    (["evaluate", "{cfg}", "--model-dir", "{md}", "--continuous", "--timeout", "nan"],
     "--timeout: sidecar.timeout: expected a number from 0 to 31622400 or null, got nan"),
    (["evaluate", "{cfg}", "--model-dir", "{md}", "--continuous", "--max-evaluations", "0"],
     "--max-evaluations: sidecar.max_evaluations: expected an integer >= 1 or null, got 0"),
    (["evaluate", "{cfg}", "--model-dir", "{md}", "--nproc", "0"], "--nproc: must be >= 1, got 0"),
    (["train", "{cfg}", "--model-dir", "{md}", "--nproc", "0"], "--nproc: must be >= 1, got 0"),
    (["train", "{cfg}", "--model-dir", "{md}", "--nproc", "1", "--nnodes", "0"], "--nnodes: must be >= 1, got 0"),
    (["train", "{cfg}", "--model-dir", "{md}", "--nproc", "1", "--max-restarts", "-1"],
     "--max-restarts: must be >= 0, got -1"),
    (["launch", "{cfg}", "--sidecar", "--model-dir", "{md}", "--nproc", "0"], "--nproc: must be >= 1, got 0"),
    (["smoke", "{cfg}", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["sweep", "{cfg}", "--space", "{md}", "--trials", "0"], "--trials: must be >= 1, got 0"),
    (["sweep", "{cfg}", "--space", "{md}", "--trials", "2", "--parallel", "0"], "--parallel: must be >= 1, got 0"),
]


@pytest.mark.parametrize(("argv", "message"), FLAGS, ids=[" ".join(a[0:1] + a[-2:]) for a, _ in FLAGS])
def test_a_numeric_flag_out_of_its_range_names_the_flag(refused, cfg, tmp_path, argv, message):
    md = tmp_path / "run"
    assert refused(*(a.format(cfg=cfg, md=md) for a in argv)) == message


def test_an_unknown_log_level_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", "BOGUS", "ls", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("cadence: error:")] == [err.strip().splitlines()[-1]]
    assert err.strip().endswith("argument --log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
                                "(any case), got 'BOGUS'")


def test_log_level_names_are_taken_in_any_case(refused, tmp_path):
    assert refused("--log-level", "wArNiNg", "ls", tmp_path / "nope") == f"model dir not found: {tmp_path / 'nope'}"
    assert logging.getLogger().level == logging.WARNING


# -- the model dir ----------------------------------------------------------------------------------------

def test_a_file_on_the_model_dirs_path_is_refused(refused, cfg, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    message = refused("train", cfg, "--model-dir", afile / "sub" / "run", "--no-progress")
    assert message == f"model dir {afile / 'sub' / 'run'}: {afile} is a file, not a directory"


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _set_immutable(path: Path, on: bool) -> None:
    """``chattr +i`` / ``-i`` on ``path``, through the ioctl (OSError where it is not allowed or supported)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (flags,) = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0)))
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags))
    finally:
        os.close(fd)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """An immutable directory (``chattr +i``): nothing can be created in it, by root neither."""
    path = tmp_path / "locked"
    path.mkdir()
    try:
        _set_immutable(path, True)
    except OSError as e:
        pytest.skip(f"cannot make a directory immutable here (FS_IOC_SETFLAGS on {path}: {e}): needs "
                    "CAP_LINUX_IMMUTABLE and a file system with the flag (ext4, xfs, btrfs)")
    try:
        yield path
    finally:
        _set_immutable(path, False)


def test_a_model_dir_this_process_may_not_create_or_write_is_refused(refused, cfg, locked):
    assert (refused("train", cfg, "--model-dir", locked / "run", "--no-progress")
            == f"model dir {locked / 'run'}: cannot create it in {locked} (permission denied)")
    assert (refused("train", cfg, "--model-dir", locked, "--no-progress")
            == f"model dir {locked}: cannot write into it (permission denied)")


@pytest.mark.parametrize("command", ["ls", "report", "export"])
def test_a_missing_model_dir_or_one_that_is_not_a_model_dir_is_bad_input(refused, tmp_path, command):
    flags = ["--format", "safetensors"] if command == "export" else []
    assert refused(command, tmp_path / "nope", *flags) == f"model dir not found: {tmp_path / 'nope'}"
    empty = tmp_path / "empty"
    empty.mkdir()
    message = refused(command, empty, *flags)
    if command == "export":
        assert message == f"{empty}/config.yaml not found: {empty} is not a cadence model dir (or was never trained)"
    else:
        assert message == f"not a cadence model dir (no config.yaml, checkpoints/ or train/): {empty}"


# -- checkpoints that do not exist ------------------------------------------------------------------------

def test_a_checkpoint_that_does_not_exist_is_bad_input(refused, cfg, tmp_path):
    md = tmp_path / "run"
    write_config(md)  # a model dir's config.yaml, and no checkpoint
    checkpoints = md / "checkpoints"
    assert refused("evaluate", cfg, "--model-dir", md, "--checkpoint", "999") == (
        f"no committed checkpoint for step 999 in {checkpoints}; available steps: []")
    assert refused("export", md, "--checkpoint", "999", "--format", "safetensors") == (
        f"no committed checkpoint for step 999 in {checkpoints}; available steps: []")
    assert refused("export", md, "--format", "safetensors") == (
        f"no best checkpoint in {md}/best (set trainer.best_checkpoint, or export --checkpoint latest)")
    assert refused("export", md, "--checkpoint", "latest", "--format", "safetensors") == (
        f"no committed checkpoint in {checkpoints}")
    # evaluate takes the same selector as export (issue 40): best/'s checkpoint, or the same one line
    assert refused("evaluate", cfg, "--model-dir", md, "--checkpoint", "best") == (
        f"no best checkpoint in {md}/best (set trainer.best_checkpoint, or evaluate --checkpoint latest)")
    assert refused("evaluate", cfg, "--model-dir", md, "--checkpoint", "latest").startswith(
        f"no committed checkpoint in {checkpoints}: nothing to evaluate")


@pytest.mark.parametrize(("text", "selected"), [("best", "best"), ("latest", "latest"), ("0", 0), ("400", 400),
                                                ("007", 7)])
def test_a_checkpoint_selector_is_best_latest_or_a_step(text, selected):
    from cadence.cli.flags import checkpoint_selector

    assert checkpoint_selector(text) == selected and type(checkpoint_selector(text)) is type(selected)


@pytest.mark.parametrize("text", ["-1", "BEST", "Latest", "", " 4", "4.0", "1e3", "0x10", "\u0663"])
def test_anything_else_is_not_a_checkpoint_selector(text):
    from cadence.cli.flags import checkpoint_selector
    from cadence.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--checkpoint: expected best, latest or a step number >= 0, got "):
        checkpoint_selector(text)


# -- the Task's code at its first use ---------------------------------------------------------------------

@pytest.mark.parametrize(("source", "expected"), [
    ("import torch\n\ndef build(:\n    pass\n", "task.class: cannot import module '{task}': {task}, line 3: SyntaxError: "),
    ("X = 1\nraise RuntimeError('no GPU here')\n",
     "task.class: importing module '{task}' raised RuntimeError: no GPU here ({task}, line 2)"),
], ids=["syntax-error", "raises-at-import"])
def test_a_task_file_that_cannot_be_imported_names_the_file_and_line(refused, tmp_path, source, expected):
    code = tmp_path / "code"
    code.mkdir()
    task = code / "broken.py"
    task.write_text(source)
    config = write_config(code, f"{task}:Broken")
    message = refused("train", config, "--model-dir", tmp_path / "run", "--no-progress")
    assert message.startswith(expected.format(task=task)), message


@pytest.mark.parametrize(("model", "shown"), [(None, "None"), (3, "a value of type int")])
def test_build_model_returning_no_module_names_it(refused, tmp_path, model, shown):
    config = write_config(tmp_path / "code", "NotAModelTask", params={"model": model})
    assert refused("train", config, "--model-dir", tmp_path / "run", "--no-progress") == (
        f"NotAModelTask.build_model() returned {shown}; expected a torch.nn.Module")
