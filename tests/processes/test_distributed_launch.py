"""``cadence train --nproc N``: the launcher command, a 2-rank run through torch's launcher
(rank-prefixed output, one reporting rank), a rank killed with SIGKILL ending the job, and the
one-line error naming the failed rank (restarts: tests/processes/test_elastic.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from cadence.cli.main import main
from cadence.cli.parser import build_parser
from cadence.cli.torchrun import torchrun_command
from cli_run import ENV, popen, run_python, run_torchrun

TASK = f"{Path(__file__).parents[1] / 'dist_worker.py'}:PidTask"


def config(tmp_path: Path, pid_dir: Path, steps: int = 24, **params) -> Path:
    pid_dir.mkdir(exist_ok=True)
    cfg = {"task": {"class": TASK, "params": {"n": 256, "pid_dir": str(pid_dir), **params}},
           "trainer": {"train_steps": steps, "steps_per_loop": 4, "checkpoint_interval": 8, "seed": 1,
                       "in_process_validation": False, "max_to_keep": None}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def command(argv: list[str]) -> list[str]:
    return torchrun_command(build_parser().parse_args(argv), python="PY")


def test_the_launcher_command():
    standalone = command(["--log-level", "debug", "train", "c.yaml", "--nproc", "2", "--model-dir", "m",
                          "--set", "a=1", "--set", "b=2", "--no-progress"])
    assert standalone == [
        "PY", "-m", "cadence.cli.torchrun_agent", "--nproc-per-node", "2", "--nnodes", "1", "--standalone",
        "--max-restarts", "0", "--tee", "3",
        "-m", "cadence", "--log-level", "debug", "train", "c.yaml", "--model-dir", "m", "--set", "a=1",
        "--set", "b=2", "--no-progress",
    ]
    nodes = command(["train", "c.yaml", "--nproc", "8", "--nnodes", "2", "--node-rank", "1",
                     "--rdzv-endpoint", "host0:29400", "--rdzv-id", "job7", "--max-restarts", "3",
                     "--rdzv-conf", "keep_alive_interval=2"])
    assert nodes[:nodes.index("-m", 3)] == [
        "PY", "-m", "cadence.cli.torchrun_agent", "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "host0:29400", "--rdzv-id", "job7",
        "--rdzv-conf", "keep_alive_interval=2", "--max-restarts", "3", "--tee", "3",
    ]
    assert nodes[nodes.index("-m", 3):] == ["-m", "cadence", "--log-level", "INFO", "train", "c.yaml"]


def test_the_launcher_flags_exist_in_this_torch():
    from torch.distributed.run import get_args_parser

    flags = command(["train", "c.yaml", "--nproc", "2", "--nnodes", "2", "--node-rank", "0",
                     "--rdzv-endpoint", "h:1", "--rdzv-id", "x", "--max-restarts", "2",
                     "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2"])
    args = get_args_parser().parse_args(flags[3:])  # `python -m cadence.cli.torchrun_agent` passes them to torch's main
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_backend) == ("2", "2", 0, "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id, args.max_restarts, args.tee, args.module) == ("h:1", "x", 2, "3", True)
    assert args.training_script == "cadence"
    assert args.rdzv_conf == "keep_alive_interval=1,keep_alive_max_attempt=2"


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "need --nproc"),
    (["--nproc", "2", "--nnodes", "2"], "need --rdzv-endpoint"),
    (["--nproc", "0"], "--nproc: must be >= 1"),
    (["--nproc", "2", "--node-rank", "3"], "--node-rank: must be in [0, 1)"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "nohost"], "expected HOST:PORT"),
    (["--max-restarts", "2"], "need --nproc"),
    (["--nproc", "2", "--max-restarts", "-1"], "--max-restarts: must be >= 0"),
    (["--nproc", "2", "--rdzv-conf", "a=1"], "--rdzv-conf: configures the c10d rendezvous"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "a=1,b"], "expected KEY=VALUE"),
])
def test_bad_launch_arguments_exit_2(argv, message, tmp_path, capsys):
    assert main(["train", str(config(tmp_path, tmp_path / "pids")), *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_nproc_inside_a_torchrun_worker_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main(["train", str(config(tmp_path, tmp_path / "pids")), "--nproc", "2"]) == 2
    assert "already runs under torchrun" in capsys.readouterr().err


def test_train_on_two_ranks(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_python(
        ["-m", "cadence", "train", str(config(tmp_path, tmp_path / "pids")), "--model-dir", str(model_dir),
         "--nproc", "2"], timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert any(line.startswith("[rank0]:") and "saved checkpoint" in line for line in lines), out
    assert any(line.startswith("[rank0]:step 24/24") for line in lines), out  # rank 0's progress
    assert any(line.startswith("[rank0]:done:") for line in lines), out
    rank1 = [line for line in lines if line.startswith("[rank1]:")]
    assert not [line for line in rank1 if "INFO" in line or "step " in line or "done:" in line], rank1
    assert sorted(p.name for p in (tmp_path / "pids").iterdir()) == ["rank0", "rank1"]
    state = json.loads((model_dir / "checkpoints" / "ckpt-24" / "state.json").read_text())["state"]["trainer"]
    assert len(state["rng"]) == 2
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == 24


def test_a_killed_rank_ends_the_job_and_is_named(tmp_path):
    pids = tmp_path / "pids"
    job = popen(
        ["-m", "cadence", "train", str(config(tmp_path, pids, steps=100000, step_sleep=0.02)),
         "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while not (pids / "rank1").exists() or not (pids / "rank0").exists():
            assert time.monotonic() < deadline and job.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        time.sleep(1.0)  # training
        victim = int((pids / "rank1").read_text())
        other = int((pids / "rank0").read_text())
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, _ = job.communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0, out
    assert elapsed < 60
    # torchrun's agent names the rank that failed first, and how
    root_cause = out[out.index("Root Cause (first observed failure)"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), out
    assert "Signal 9 (SIGKILL)" in root_cause, out
    assert out.strip().splitlines()[-1].startswith(  # and cadence's own one-line error
        f"cadence: failed: rank 1 (local rank 1, pid {victim}) was killed by SIGKILL; "), out[-3000:]
    assert "the job was not restarted (--max-restarts 0;" in out.strip().splitlines()[-1]
    with pytest.raises(ProcessLookupError):  # the agent stopped the other rank
        os.kill(other, 0)


def test_a_rank_raising_ends_the_job_with_its_error_and_rank(tmp_path):
    proc = run_python(
        ["-m", "cadence", "train", str(config(tmp_path, tmp_path / "pids", fail_rank=1)),
         "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress"], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert re.search(r"^\[rank1\]:.*RuntimeError: planted failure on rank 1", out, re.M), out
    root_cause = out[out.index("Root Cause (first observed failure)"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*1 ", root_cause), out  # not a SIGABRT
    assert re.search(r"^cadence: failed: rank 1 \(local rank 1, pid \d+\) exited with status 1; ", out, re.M), out


def test_train_under_an_external_torchrun(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_torchrun(2, "-m", "cadence", "train", str(config(tmp_path, tmp_path / "pids", steps=8)),
                        "--model-dir", str(model_dir), "--no-progress", env={"COLUMNS": "200"}, timeout=120, external=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = json.loads((model_dir / "checkpoints" / "ckpt-8" / "state.json").read_text())["state"]["trainer"]
    assert len(state["rng"]) == 2 and state["data"]["state"] == {"epoch": 0, "offset": 8 * 2 * 8}


def test_train_with_only_what_a_kubernetes_pytorchjob_sets(tmp_path):
    """One process per pod, as Kubernetes' PyTorchJob starts them: MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK,
    no LOCAL_RANK (local rank 0). Without MASTER_PORT, one line and exit 2 before anything is trained."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg, model_dir = config(tmp_path, tmp_path / "pids", steps=8), tmp_path / "run"
    base = {k: v for k, v in ENV.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    argv = ["-m", "cadence", "train", str(cfg), "--model-dir", str(model_dir), "--no-progress"]
    pods = [popen(argv, env={**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                             "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(2)]
    outs = [pod.communicate(timeout=120)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(outs)
    state = json.loads((model_dir / "checkpoints" / "ckpt-8" / "state.json").read_text())["state"]["trainer"]
    assert len(state["rng"]) == 2  # two ranks

    lone = run_python(argv[:5] + [str(tmp_path / "other"), "--no-progress"],
                      env={**base, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "RANK": "0"}, timeout=60)
    assert lone.returncode == 2, lone.stdout + lone.stderr
    assert lone.stderr.strip().splitlines()[-1] == (
        "cadence: error: WORLD_SIZE=2 but MASTER_PORT is not set; start the processes with torchrun (or `cadence "
        "train --nproc N`), which sets them")
    assert not (tmp_path / "other").exists() or not list((tmp_path / "other").rglob("ckpt-*"))
