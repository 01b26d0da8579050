"""A model dir that the nodes of a job do not share is caught before any step (issue 28, item 2).

Two torchrun nodes on 127.0.0.1 train one job with ``--model-dir D``; node 1 runs in a mount namespace
of its own where D's parent is a bind mount of another directory: the same path, another disk, as
node-local disks mounted at the same path on every machine. Both nodes exit 2 with the same one line,
nothing is trained, and the checkpoint already in D is untouched. (That a shared model dir passes the
check is what every multi-process training test does: the check runs for every job of several ranks.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_run import ENV, popen, run_cadence
from configs import write_config
from multinode import free_port, listening


def _unshare_works() -> str | None:
    """None when this process may make a private mount namespace with a bind mount; else why not."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    try:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", "mount --bind / /mnt"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -m failed: {e}"
    return None if proc.returncode == 0 else f"needs root to bind-mount in a mount namespace: {proc.stderr.strip()}"


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the writer lease's, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != ".writer"}


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def test_nodes_with_different_disks_at_the_model_dirs_path_exit_2_before_any_step(tmp_path):
    reason = _unshare_works()
    if reason is not None:
        pytest.skip(reason)
    shared, other = tmp_path / "shared", tmp_path / "other"  # node 1 sees `other` at `shared`'s path
    other.mkdir()
    model_dir = shared / "run"
    config = write_config(tmp_path, trainer={"train_steps": 16})
    run_cadence("train", str(config), "--model-dir", str(model_dir), "--set", "trainer.train_steps=8",
                "--no-progress", check=True)
    saved = _files(model_dir)
    assert "checkpoints/ckpt-8/MANIFEST.json" in saved and "train/metrics.jsonl" in saved

    port = free_port()
    node = ["-m", "cadence", "train", str(config), "--model-dir", str(model_dir), "--nproc", "1", "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-progress", "--node-rank"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs: list[subprocess.Popen] = []
    try:
        with open(logs[0], "w") as log:  # node 0 first: it hosts the rendezvous store
            procs.append(popen([*node, "0"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while not listening(port):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.05)
        # node 1: a fresh interpreter (the test's fork server runs in this mount namespace), and its ranks too
        with open(logs[1], "w") as log:
            procs.append(subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c",
                 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(other), str(shared),
                 sys.executable, *node, "1"],
                env=ENV, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [proc.wait(120) for proc in procs]
    finally:
        _stop(procs)
    outputs = [log.read_text() for log in logs]
    assert codes == [2, 2], "\n".join(f"--- node {i}:\n{out[-3000:]}" for i, out in enumerate(outputs))
    # torch numbers the nodes by their agents' pids: node 1's agent, started later, is node 1 unless the pids
    # wrapped around; then rank 1 sees the lease of the run that saved the checkpoint at the chief's file name
    pattern = re.compile(
        rf"cadence: error: model dir {re.escape(str(model_dir))} is not shared: rank 0 \(node (\d), host \S+\) wrote "
        r"\.writer/lease-\d{12}\.json there, and rank 1 \(node (\d), host \S+\) (does not see it|finds another "
        r"file by that name \(a lease of pid \d+ on host \S+\)); every node must mount the same storage at that "
        r"path \(a shared file system or an object store URL\)")
    for out in outputs:
        assert "Traceback" not in out, out
        lines = out.strip().splitlines()
        match = pattern.fullmatch(lines[-1])
        assert match and {match.group(1), match.group(2)} == {"0", "1"}, out[-3000:]
        assert sum("is not shared" in line for line in lines) == 1, out  # once per node: not once per rank
    assert _files(model_dir) == saved  # nothing trained, saved or written over: the checkpoint is intact
    assert not [p for p in other.rglob("*") if p.relative_to(other).parts[:2] != ("run", ".writer")]
