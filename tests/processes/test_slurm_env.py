"""``cadence train`` as the tasks of an ``srun`` step, without a Slurm: two processes given the
environment srun gives its tasks (tests/slurm_fakes.py) train as two ranks, bit-identical to
``--nproc 2``; and a SIGUSR1 to both (``#SBATCH --signal=USR1@N``) with ``--requeue`` commits a
checkpoint, has rank 0 alone run ``scontrol requeue JOB`` (a fake one, first on PATH) once after the
commit, exits 0, and the requeued job resumes from that checkpoint to the same weights."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cadence.cluster.slurm import MASTER_PORT_BASE
from cli_run import ENV, popen, run_cadence
from configs import write_config
from slurm_fakes import calls, fake_scontrol, step_env, without_launcher_env

BASE_ENV = {**without_launcher_env(ENV), "COLUMNS": "200"}


def weights(model_dir: Path, step: int) -> bytes:
    return (model_dir / "checkpoints" / f"ckpt-{step}" / "model.safetensors").read_bytes()


def free_job_id() -> str:
    """A job id whose derived rendezvous port (15000 + id % 5000) is free now."""
    for _ in range(200):
        port = random.randrange(MASTER_PORT_BASE, MASTER_PORT_BASE + 5000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port - MASTER_PORT_BASE + 5000 * random.randrange(1, 100))
    raise RuntimeError("no free port in 15000-19999")


def srun(args: list[str], job: str, *, ntasks: int = 2, extra: dict[str, str] | None = None,
         path: Path | None = None) -> list[subprocess.Popen]:
    """``cadence ARGS`` as the ``ntasks`` tasks of step 0 of Slurm job ``job`` (``path``: first on PATH)."""
    procs = []
    for rank in range(ntasks):
        env = {**BASE_ENV, **step_env(rank, ntasks, job_id=job), **(extra or {})}
        if path is not None:
            env["PATH"] = f"{path}{os.pathsep}{env.get('PATH', '')}"
        procs.append(popen(["-m", "cadence", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str]]:
    return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=timeout)]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """The config, and a model dir trained by ``cadence train --nproc 2`` to step 24."""
    tmp = tmp_path_factory.mktemp("slurm")
    config = write_config(tmp, params={"n": 256}, trainer={"checkpoint_interval": None})
    run = tmp / "straight"
    run_cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress", check=True,
                env={"COLUMNS": "200"})
    return config, run


def test_two_srun_tasks_train_as_two_ranks_bit_identical_to_nproc_2(tmp_path, straight):
    config, reference = straight
    run = tmp_path / "run"
    results = finish(srun(["train", str(config), "--model-dir", str(run), "--no-progress"], free_job_id()))
    for code, out in results:
        assert code == 0, out
    assert "done" in results[0][1] and "done" not in results[1][1]  # rank 0 reports, rank 1 does not
    assert weights(run, 24) == weights(reference, 24)


def test_sigusr1_with_requeue_saves_rank_0_requeues_once_and_the_requeued_job_resumes_exactly(tmp_path, straight):
    config, reference = straight
    run, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    bin_dir, log = fake_scontrol(tmp_path / "fake")
    job = free_job_id()
    procs = srun(["train", str(config), "--model-dir", str(run), "--no-progress", "--requeue",
                  "--set", "task.params.step_sleep=0.1", "--set", f"task.params.pid_dir={pids}"], job,
                 extra={"FAKE_SCONTROL_WATCH": str(run / "checkpoints")}, path=bin_dir)
    deadline = time.monotonic() + 120
    metrics = run / "train" / "metrics.jsonl"
    while not (len(list(pids.iterdir())) == 2 and metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), finish(procs)
        time.sleep(0.02)
    for rank in (0, 1):  # srun --signal: every task gets it
        os.kill(int((pids / f"rank{rank}").read_text()), 10)  # SIGUSR1
    results = finish(procs)
    for code, out in results:
        assert code == 0, out
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-"))
    assert len(steps) == 1 and 0 < steps[0] < 24, steps
    assert not (run / "checkpoints" / "FINAL").exists()
    # rank 0 alone, once, with the job's id, after that checkpoint was committed
    assert calls(log) == [f"procid=0 committed={steps[0]}, args=requeue {job}"]
    assert f"requeued the job: it resumes from the checkpoint at step {steps[0]}" in results[0][1]

    requeued = finish(srun(["train", str(config), "--model-dir", str(run), "--no-progress", "--requeue"], job,
                           extra={"SLURM_RESTART_COUNT": "1"}, path=bin_dir))
    for code, out in requeued:
        assert code == 0, out
    assert "Slurm requeued the job (restart 1)" in requeued[0][1]
    assert weights(run, 24) == weights(reference, 24)
    assert len(calls(log)) == 1
