"""A property-based fuzzer of the command line and the file system, beside the config fuzzer
(``test_config_fuzz.py``): commands typed with odd argument values, and with paths that are a regular
file, a path under a file, a user's non-empty directory, an empty one, a directory nothing may be
created in (immutable), one that does not exist, or a trained model dir.

Each example runs ``cadence ...`` in-process in a fresh sandbox and checks the house rule for bad
input: exit 2 with exactly one line (``cadence: error: ...``, or argparse's usage and error; a file
with several errors, as the config fuzzer allows: one line each, every one naming the file), no
traceback; and the sandbox afterwards byte for byte as it was. A command the fuzzer may send that is
good input (an export into a new directory, a listing) must exit 0 and change only what it owns (the
export's directory, the report's two files). The commands that would start training or processes
(``train``, ``launch``, ``smoke``, ``sweep``) are always sent at least one bad value, which must be
refused before anything starts.

The fast tier runs :data:`EXAMPLES` examples, derandomized; a longer soak:
``CADENCE_FUZZ_EXAMPLES=2000 pytest tests/unit/test_cli_fuzz.py`` (random each run).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cadence.cli.main import main
from configs import write_config

SOAK = int(os.environ.get("CADENCE_FUZZ_EXAMPLES", "0"))
EXAMPLES = SOAK or 60
FUZZ = settings(max_examples=EXAMPLES, derandomize=not SOAK, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

UNWRITABLE = ["file", "file/sub", "locked", "locked/sub", "model/checkpoints/ckpt-4/state.json"]
"""Paths nothing can be created at: a regular file, a path under it, an immutable directory (``chattr
+i``: nothing can be created in it, even by root), a path under it, a file of a checkpoint."""
BAD_PATHS = [*UNWRITABLE, "user"]
"""Paths no command may write into or replace: the unwritable ones and a user's non-empty directory."""
PATHS = [*BAD_PATHS, "empty", "missing", "missing/deep/sub", "model"]
"""Every kind of path the fuzzer types, relative to the sandbox."""
BAD_COUNTS = ["-1", "-5", "0", "-0", "nan", "x", "", " ", "1.5", "0x10", "1e3"]
"""Values typed for a flag that takes a count (an int >= 1): each is bad."""
BAD_SECONDS = ["-1", "-5", "nan", "inf", "-inf", "1e999", "x", "", " ", "0x10", "-1e-9"]
"""Values typed for a flag that takes seconds (a finite float >= 0): each is bad."""
CHECKPOINTS = ["best", "latest", "4", "8", "999", "-5", "-1", "x", "", "BEST", "1.0", "04x"]
"""Values typed for ``--checkpoint``: the first four name checkpoints of the trained dir."""


def _immutable(path: Path, on: bool) -> bool:
    """``chattr +i`` (or ``-i``) on ``path``; False where the file system or the user cannot."""
    done = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
    return done.returncode == 0


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: its kind, mode and content (a file's digest, a link's target)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                out[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                out[str(path.relative_to(root))] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[str(path.relative_to(root))] = ("file", stat.S_IMODE(info.st_mode), digest)
    return out


def _changed(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A TinyTask model dir trained in-process (8 steps, checkpoints at 4 and 8, a best by loss) and
    its config: ``(model_dir, config)``."""
    root = tmp_path_factory.mktemp("trained")
    config = write_config(root, trainer={"train_steps": 8, "checkpoint_interval": 4, "validation_interval": 4,
                                         "best_checkpoint": {"metric": "loss", "higher_is_better": False}})
    assert main(["train", str(config), "--model-dir", str(root / "run"), "--no-progress"]) == 0
    return root / "run", config


@pytest.fixture
def sandboxes(tmp_path_factory: pytest.TempPathFactory, trained: tuple[Path, Path]) -> Iterator[list[Path]]:
    """Makes a fresh sandbox per call (appended to the yielded list; each one's ``locked`` made mutable
    again afterwards): ``config.yaml`` (the trained run's), ``space.yaml``, ``file``, ``user/`` (a README
    and ``src/notes.txt``), ``empty/``, ``locked/`` (immutable) and ``model/`` (a copy of the trained dir)."""
    made: list[Path] = []
    yield made
    for root in made:
        _immutable(root / "locked", False)


def _new_sandbox(tmp_path_factory: pytest.TempPathFactory, trained: tuple[Path, Path], made: list[Path]) -> Path:
    model_dir, config = trained
    root = tmp_path_factory.mktemp("sandbox")
    made.append(root)
    shutil.copy(config, root / "config.yaml")
    (root / "space.yaml").write_text("params:\n  task.params.hidden: {type: int, low: 4, high: 8}\nmetric: loss\n"
                                     "direction: minimize\n")
    (root / "file").write_text("a user's file\n")
    (root / "user" / "src").mkdir(parents=True)
    (root / "user" / "README").write_text("my project\n")
    (root / "user" / "src" / "notes.txt").write_text("notes\n")
    (root / "empty").mkdir()
    (root / "locked").mkdir()
    if not _immutable(root / "locked", True):
        pytest.skip("chattr +i is not available here: the fuzzer needs a directory nothing can be created in")
    shutil.copytree(model_dir, root / "model", symlinks=True)
    return root


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[list[str], bool, list[str]]:
    """``(argv with sandbox-relative paths, whether it must be refused, what it may write on success)``.

    A line that must be refused holds a value that is bad input (exit 2); another may run (exit 0) or
    be refused. What it may write are sandbox-relative paths (and their new parents)."""
    path = st.sampled_from(PATHS)
    unwritable = st.sampled_from(UNWRITABLE)
    count, seconds = st.sampled_from(BAD_COUNTS), st.sampled_from(BAD_SECONDS)
    command = draw(st.sampled_from(["export", "evaluate", "sidecar", "train", "ls", "report", "launch", "smoke",
                                    "sweep", "log-level"]))
    if command == "export":
        model, checkpoint, out = draw(path), draw(st.sampled_from(CHECKPOINTS)), draw(st.one_of(st.none(), path))
        argv = ["export", model, "--checkpoint", checkpoint, "--format", "safetensors"]
        argv += [] if out is None else ["--out", out]
        good_out = out in (None, "empty", "missing", "missing/deep/sub")
        refused = not good_out or model != "model" or checkpoint not in ("best", "latest", "4", "8")
        return argv, refused, [f"{model}/export"] if out is None else [out]
    if command == "evaluate":
        model_dir, checkpoint = draw(path), draw(st.sampled_from(CHECKPOINTS))
        refused = model_dir != "model" or checkpoint not in ("best", "latest", "4", "8")
        return ["evaluate", "config.yaml", "--model-dir", model_dir, "--checkpoint", checkpoint], refused, []
    if command == "sidecar":
        return (["evaluate", "config.yaml", "--continuous", "--model-dir", draw(unwritable), "--timeout", "1"], True,
                [])
    if command == "train":
        flags = draw(st.sampled_from([[], ["--nproc", draw(count)], ["--set", f"trainer.train_steps={draw(count)}"]]))
        return ["train", "config.yaml", "--model-dir", draw(unwritable), "--no-progress", *flags], True, []
    if command == "ls":
        return ["ls", draw(path)], False, []
    if command == "report":
        model_dir, out = draw(path), draw(st.one_of(st.none(), path))
        argv = ["report", model_dir] + ([] if out is None else ["--out", out])
        refused = model_dir != "model" or out not in (None, "missing", "missing/deep/sub")
        owned = [f"{model_dir}/report.html", f"{model_dir}/report.png"] if out is None else [
            out, str(Path(out).with_suffix(".png"))]
        return argv, refused, owned
    if command == "launch":
        bad = draw(st.sampled_from(["grace", "nproc", "model-dir"]))
        argv = ["launch", "config.yaml", "--sidecar", "--model-dir", draw(unwritable) if bad == "model-dir" else "missing"]
        argv += ["--grace", draw(seconds)] if bad == "grace" else []
        argv += ["--nproc", draw(count)] if bad == "nproc" else []
        return argv, True, []
    if command == "smoke":
        bad = draw(st.sampled_from(["steps", "keep"]))
        argv = ["smoke", "config.yaml"]
        argv += ["--steps", draw(count)] if bad == "steps" else ["--keep", draw(st.sampled_from(BAD_PATHS))]
        return argv, True, []
    if command == "sweep":
        bad = draw(st.sampled_from(["trials", "parallel", "space", "sweep-dir", "grace"]))
        argv = ["sweep", "config.yaml", "--space", draw(st.sampled_from(BAD_PATHS)) if bad == "space" else "space.yaml",
                "--trials", draw(count) if bad == "trials" else "1",
                "--sweep-dir", draw(unwritable) if bad == "sweep-dir" else "missing"]
        argv += ["--parallel", draw(count)] if bad == "parallel" else []
        argv += ["--grace", draw(seconds)] if bad == "grace" else []
        return argv, True, []
    level = draw(st.sampled_from(["BOGUS", "", "warn-ing", "NOTSET0", "debug1"]))
    return ["--log-level", level, "ls", draw(path)], True, []


def _absolute(argv: list[str], root: Path) -> list[str]:
    """The sandbox-relative paths of ``argv`` made absolute (the commands run from another directory)."""
    return [str(root / a) if a in PATHS or a in ("config.yaml", "space.yaml") else a for a in argv]


def _owned(path: str, owned: list[str], before: dict[str, tuple]) -> bool:
    """Whether a change at ``path`` is the command's own: at or under a path it owns, or a directory it
    created on the way to one."""
    if any(path == o or path.startswith(o.rstrip("/") + "/") for o in owned):
        return True
    return path not in before and any(o.startswith(path + "/") for o in owned)


EXPORT = ["export", "model", "--checkpoint", "latest", "--format", "safetensors"]


@FUZZ
@given(line=command_lines())
# the cases of issue 39, always run: a user's directory or file as --out (their files were deleted), and paths
# nothing can be created at as a model dir, --keep or a report
@example(line=([*EXPORT, "--out", "user"], True, ["user"]))
@example(line=([*EXPORT, "--out", "file"], True, ["file"]))
@example(line=([*EXPORT, "--out", "model"], True, ["model"]))
@example(line=([*EXPORT, "--out", "locked/sub"], True, ["locked/sub"]))
@example(line=([*EXPORT, "--out", "missing/deep/sub"], False, ["missing/deep/sub"]))
@example(line=(["report", "model", "--out", "file"], True, ["file", "file.png"]))
@example(line=(["report", "model", "--out", "file/sub"], True, ["file/sub", "file/sub.png"]))
@example(line=(["train", "config.yaml", "--model-dir", "file/sub", "--no-progress"], True, []))
@example(line=(["train", "config.yaml", "--model-dir", "locked", "--no-progress"], True, []))
@example(line=(["evaluate", "config.yaml", "--model-dir", "file/sub", "--checkpoint", "4"], True, []))
@example(line=(["evaluate", "config.yaml", "--model-dir", "model", "--checkpoint", "-5"], True, []))
@example(line=(["export", "model", "--checkpoint", "999", "--format", "safetensors"], True, ["model/export"]))
@example(line=(["launch", "config.yaml", "--sidecar", "--model-dir", "missing", "--grace", "-1"], True, []))
@example(line=(["evaluate", "config.yaml", "--continuous", "--model-dir", "locked", "--timeout", "1"], True, []))
@example(line=(["smoke", "config.yaml", "--keep", "locked/sub"], True, []))
@example(line=(["--log-level", "BOGUS", "ls", "model"], True, []))
@example(line=(["ls", "user"], True, []))
def test_any_command_line_on_any_path_exits_2_with_one_line_and_changes_nothing(tmp_path_factory, trained, sandboxes,
                                                                               capsys, line):
    argv, refused, owned = line
    root = _new_sandbox(tmp_path_factory, trained, sandboxes)
    before = _snapshot(root)
    try:
        code = main(_absolute(argv, root))
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    err = capsys.readouterr().err
    changed = _changed(before, _snapshot(root))
    assert "Traceback" not in err, err
    if code == 2:
        lines = err.strip().splitlines()
        if lines and lines[0].startswith("usage: "):  # argparse's own refusal: the usage, then one error line
            assert lines[-1].startswith("cadence") and ": error: " in lines[-1], err
        else:  # one line; a config file with several errors: one line each, every one naming the file
            assert lines and lines[0].startswith("cadence: error: "), err
            source = lines[0].removeprefix("cadence: error: ").split(": ", 1)[0] + ": "
            assert all(line.startswith(source) for line in lines[1:]), err
        assert changed == [], f"{argv} exited 2 and changed {changed}"
    else:
        assert not refused and code == 0, f"{argv} exited {code}, not 2: {err}"
        stray = [p for p in changed if not _owned(p, owned, before)]
        assert stray == [], f"{argv} changed {stray} (it owns {owned})"
