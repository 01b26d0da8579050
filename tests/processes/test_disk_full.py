"""A full disk under the model dir, as a user meets it through ``cadence train``: the save fails with
from configs import write_config as tiny_config
one line naming the directory, the step and the free space (exit 1, no traceback), nothing partial
is left, the previous checkpoint is intact, and once space is freed the run resumes exactly.

Real faults, no mocks: a small tmpfs mounted under the model dir (we are root on Linux). Where
mounting is not permitted, a file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored: writes past it
fail with ``EFBIG``) stands in for it; the cases that need a file system filling up over several
files are skipped then. ``CADENCE_TEST_DISK=rlimit`` forces the file-size limit.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from cadence.checkpoint.space import space_error
from cadence.storage import Storage
from cli_run import ENV as CLI_ENV, popen, run_cadence
from configs import write_config as tiny_config

resource = pytest.importorskip("resource")  # POSIX only

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
ENV = {**CLI_ENV, "PYTHONDONTWRITEBYTECODE": "1"}
HIDDEN = 4096  # a checkpoint of ~620 KB: model.safetensors ~200 KB, optimizer state ~400 KB
KB = 1024
ONE_CHECKPOINT = 1024 * KB  # room for one checkpoint, not for two
MODEL_ONLY = 256 * KB  # model.safetensors fits, the optimizer state does not
NOTHING = 128 * KB  # not even model.safetensors fits
FREE = re.compile(r"\(\d+(\.\d)? (B|KiB|MiB|GiB) free\)")


class Disk:
    """Makes directories small: a tmpfs of ``size`` bytes mounted on them, or (``kind ==
    "rlimit"``) a limit of ``size`` bytes per file for the trainer processes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.mounts: list[Path] = []
        self.file_limit: int | None = None

    def shrink(self, directory: Path, size: int) -> None:
        """Give ``directory`` (created if needed) ``size`` bytes."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == "rlimit":
            self.file_limit = size
            return
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
        self.mounts.append(directory)

    def free_up(self) -> None:
        """Room again: the tmpfs grows to 64 MiB, or the file-size limit is lifted."""
        self.file_limit = None
        for directory in self.mounts:
            subprocess.run(["mount", "-o", "remount,size=64m", str(directory)], check=True)

    def require_tmpfs(self) -> None:
        if self.kind != "tmpfs":
            pytest.skip("needs a small file system that fills up (mounting a tmpfs is not permitted here)")

    def preexec(self) -> Callable[[], None] | None:
        limit = self.file_limit
        if limit is None:
            return None

        def apply() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        return apply

    def unmount(self) -> None:
        for directory in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(directory)], check=False)
        self.mounts.clear()


def _can_mount(probe: Path) -> bool:
    if os.environ.get("CADENCE_TEST_DISK") == "rlimit" or shutil.which("mount") is None:
        return False
    probe.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                                 capture_output=True).returncode == 0
    except OSError:
        return False
    if mounted:
        subprocess.run(["umount", str(probe)], check=True)
    return mounted


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    small = Disk("tmpfs" if _can_mount(tmp_path / f"probe-{uuid.uuid4().hex}") else "rlimit")
    try:
        yield small
    finally:
        small.unmount()


def write_config(path: Path, steps: int = 40, interval: int = 10, **params: object) -> Path:
    return tiny_config(path.parent, TASK, name=path.name, params={"hidden": HIDDEN, **params},
                       trainer={"train_steps": steps, "steps_per_loop": 5, "checkpoint_interval": interval,
                                "validation_interval": 20, "max_to_keep": 1, "seed": 3})


def cadence(*args: str, disk: Disk | None = None) -> subprocess.CompletedProcess:
    return run_cadence(*args, env=ENV, timeout=300,
                       preexec_fn=disk.preexec() if disk else None)


def train(config: Path, run: Path, *extra: str, disk: Disk | None = None) -> subprocess.CompletedProcess:
    return cadence("train", str(config), "--model-dir", str(run), "--no-progress", *extra, disk=disk)


def async_flag(async_save: bool) -> list[str]:
    return ["--set", f"checkpoint.async_save={str(async_save).lower()}"]


def the_error(result: subprocess.CompletedProcess, directory: Path) -> str:
    """The one error line of a run that failed for want of space in ``directory``; checks that it
    exited 1 without a traceback and left no temp dir behind."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("cadence: failed:")]
    assert len(errors) == 1, result.stderr
    assert "could not release the writer lease" not in result.stderr, result.stderr  # expected on a full disk
    line = errors[0]
    assert f" in {directory}: " in line and FREE.search(line), line
    assert not list(directory.glob("*.tmp-*")), sorted(p.name for p in directory.iterdir())
    return line


def failed_step(line: str) -> int:
    match = re.search(r"\bstep (\d+)\b", line)
    assert match, line
    return int(match.group(1))


def committed(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.glob("ckpt-*") if (p / "MANIFEST.json").exists())


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 40-step run on a roomy disk: the reference for exact resume."""
    base = tmp_path_factory.mktemp("straight")
    result = train(write_config(base / "config.yaml"), base / "run")
    assert result.returncode == 0, result.stderr
    return base / "run"


def assert_resumes_exactly(config: Path, run: Path, straight: Path, disk: Disk) -> None:
    disk.free_up()
    result = train(config, run)
    assert result.returncode == 0, result.stderr
    final = Path("checkpoints", "ckpt-40")
    weights = sorted(p.name for p in (straight / final).iterdir() if p.name not in ("state.json", "MANIFEST.json"))
    assert weights and sorted(p.name for p in (run / final).iterdir()) == sorted([*weights, "state.json", "MANIFEST.json"])
    for name in weights:  # model and optimizer state
        assert (run / final / name).read_bytes() == (straight / final / name).read_bytes(), name
    assert cadence("ls", str(run), "--verify").returncode == 0


# ------------------------------------------------------------------ the save fails


@pytest.mark.parametrize(("async_save", "size"), [(False, MODEL_ONLY), (True, MODEL_ONLY), (False, NOTHING)],
                         ids=["sync-in-optimizer-state", "async-in-optimizer-state", "sync-in-model"])
def test_the_first_save_fails_with_one_line_and_the_run_resumes_exactly(tmp_path, disk, straight, async_save, size):
    config, run = write_config(tmp_path / "config.yaml"), tmp_path / "run"
    checkpoints = run / "checkpoints"
    disk.shrink(checkpoints, size)
    line = the_error(train(config, run, *async_flag(async_save), disk=disk), checkpoints)
    assert failed_step(line) == 10
    assert committed(checkpoints) == []
    assert_resumes_exactly(config, run, straight, disk)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_later_save_fails_leaving_the_previous_checkpoint_intact(tmp_path, disk, straight, async_save):
    disk.require_tmpfs()
    config, run = write_config(tmp_path / "config.yaml"), tmp_path / "run"
    checkpoints = run / "checkpoints"
    disk.shrink(checkpoints, ONE_CHECKPOINT)
    line = the_error(train(config, run, *async_flag(async_save), disk=disk), checkpoints)
    assert failed_step(line) == 20
    assert committed(checkpoints) == ["ckpt-10"]
    listed = cadence("ls", str(run), "--verify")
    assert listed.returncode == 0 and "verified" in listed.stdout, listed.stdout + listed.stderr
    assert_resumes_exactly(config, run, straight, disk)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_final_save_fails_with_one_line(tmp_path, disk, async_save):
    config, run = write_config(tmp_path / "config.yaml", steps=10, interval=1000), tmp_path / "run"
    checkpoints = run / "checkpoints"
    disk.shrink(checkpoints, MODEL_ONLY)
    line = the_error(train(config, run, *async_flag(async_save), disk=disk), checkpoints)
    assert failed_step(line) == 10
    assert committed(checkpoints) == [] and not (checkpoints / "FINAL").exists()
    disk.free_up()
    assert train(config, run).returncode == 0
    assert committed(checkpoints) == ["ckpt-10"] and (checkpoints / "FINAL").exists()


def fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s file system with a file; return it."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 * KB))
                f.flush()
        except OSError:
            pass
    return filler


def test_writing_final_fails_with_one_line(tmp_path, disk):
    disk.require_tmpfs()
    config, run = write_config(tmp_path / "config.yaml"), tmp_path / "run"
    checkpoints = run / "checkpoints"
    disk.shrink(checkpoints, 4 * ONE_CHECKPOINT)
    assert train(config, run).returncode == 0
    (checkpoints / "FINAL").unlink()  # as if the run had died between its last commit and FINAL
    filler = fill(checkpoints)
    line = the_error(train(config, run), checkpoints)
    assert "FINAL for step 40" in line
    assert committed(checkpoints) == ["ckpt-40"] and not (checkpoints / "FINAL").exists()
    filler.unlink()
    assert train(config, run).returncode == 0 and (checkpoints / "FINAL").exists()


def test_exporting_the_best_checkpoint_fails_with_one_line(tmp_path, disk):
    disk.require_tmpfs()
    config, run = write_config(tmp_path / "config.yaml"), tmp_path / "run"
    best = run / "best"
    disk.shrink(best, MODEL_ONLY)
    result = train(config, run, "--set", "trainer.best_checkpoint.metric=accuracy")
    line = the_error(result, best)
    assert failed_step(line) == 20  # the first evaluation
    assert committed(best) == [] and not (best / "best.json").exists()
    assert cadence("ls", str(run), "--verify").returncode == 0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_on_preemption_fails_with_one_line(tmp_path, disk, async_save):
    disk.require_tmpfs()
    config, run = write_config(tmp_path / "config.yaml", steps=200, step_sleep=0.05), tmp_path / "run"
    checkpoints = run / "checkpoints"
    disk.shrink(checkpoints, ONE_CHECKPOINT)
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(run),
                             "--no-progress", *async_flag(async_save)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not (checkpoints / "ckpt-10" / "MANIFEST.json").exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    line = the_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), checkpoints)
    assert 10 < failed_step(line) <= 20
    assert committed(checkpoints) == ["ckpt-10"]


# ------------------------------------------------------------------ telling a full disk apart


def test_space_error_finds_the_failed_write_behind_a_library_error(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 2048 vs 1940")  # noqa: B904 - as torch.save leaves it
    except RuntimeError as e:
        wrapped = e
    local = space_error(wrapped, Storage(str(tmp_path)), "save checkpoint step 7")
    assert local is not None and str(local).startswith(f"cannot save checkpoint step 7 in {tmp_path}: no space left")
    assert FREE.search(str(local))
    remote = space_error(wrapped, Storage("memory://cadence-disk-full/ckpts"), "save checkpoint step 7")
    assert remote is not None and " in memory://" in str(remote) and "free" not in str(remote)
    assert space_error(RuntimeError("something else"), Storage(str(tmp_path)), "save") is None
    assert space_error(OSError(errno.EACCES, "Permission denied"), Storage(str(tmp_path)), "save") is None


def test_a_torch_save_into_a_full_disk_is_a_space_error(tmp_path, disk):
    """torch.save turns the failed write into ``RuntimeError: unexpected pos``; the save still
    reports the full disk, and leaves nothing."""
    import torch

    from cadence.checkpoint import CheckpointManager
    from cadence.errors import CheckpointSpaceError

    class TorchState:
        def save_checkpoint(self, writer):
            with writer.open("state.pt") as f:
                torch.save({"w": torch.zeros(64 * KB)}, f)  # 256 KiB of tensor data

    disk.require_tmpfs()
    checkpoints = tmp_path / "checkpoints"
    disk.shrink(checkpoints, MODEL_ONLY // 2)
    manager = CheckpointManager(str(checkpoints))
    with pytest.raises(CheckpointSpaceError, match=rf"^cannot save checkpoint step 3 in {checkpoints}: ") as caught:
        manager.save(3, {"torch": TorchState()})
    assert FREE.search(str(caught.value))
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert manager.steps() == [] and not list(checkpoints.iterdir())
