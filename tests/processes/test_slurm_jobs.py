"""cadence on a real Slurm: the jobs are examples/slurm/'s scripts, submitted with ``sbatch`` to the
one-machine cluster of the ``slurm_cluster`` fixture (tests/slurm_cluster.py), with only the sizes,
the config, the model dir and the interpreter given on the command line; so the examples cannot rot.

Every Slurm test lives in this one module: one cluster per machine, and ``--dist loadscope`` gives a
module to one xdist worker. The four jobs are submitted together, at the module's start (``jobs``),
and run side by side; each test waits for its own:

- a one-task job trains to FINAL (``reference``);
- a job held at its first step gets SIGUSR1 (``scancel --signal=USR1``, what ``--signal=USR1@N``
  sends to the steps before the time limit): cadence commits, requeues it (``--requeue``), and the
  requeued job resumes and ends bit-identical to ``reference``;
- the sidecar job (``--dependency=after:`` that job), two tasks (a sidecar of 2 ranks), evaluates
  each of its checkpoints once;
- a two-task job (the multi-node script on one node) trains as two ranks.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cadence.summaries.metrics_file import read_metrics
from cli_run import ENV, ROOT
from configs import write_config
from slurm_cluster import FINISHED, SlurmCluster, brief

EXAMPLES = ROOT / "examples" / "slurm"
TRAINER: dict[str, Any] = {"train_steps": 24, "steps_per_loop": 4, "checkpoint_interval": 8,
                           "validation_interval": None, "max_to_keep": None, "seed": 1}
SIDECAR = {"mode": "every", "poll_interval": 0.1, "timeout": 120}
SMALL = ["--cpus-per-task=1", "--time=10", "--gpus-per-task=0"]
"""Command-line options over the scripts' ``#SBATCH`` lines: sizes for the test cluster (no GPUs)."""
TIMEOUT = 180.0


@dataclass
class Job:
    id: int
    model_dir: Path
    output: Path


@dataclass
class Jobs:
    reference: Job
    requeued: Job
    sidecar: Job
    two_ranks: Job
    hold: Path
    pids: Path


def _submit(cluster: SlurmCluster, script: str, work: Path, config: Path, model_dir: Path, *options: str) -> Job:
    output = work / f"{script}.{model_dir.name}.out"
    env = {**ENV, "CONFIG": str(config), "MODEL_DIR": str(model_dir), "PYTHON": sys.executable}
    job_id = cluster.submit(EXAMPLES / script, *SMALL, f"--output={output}", f"--chdir={work}", *options, env=env)
    return Job(job_id, model_dir, output)


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """The module's jobs, submitted at once (see the module's docstring)."""
    work = tmp_path_factory.mktemp("slurm-jobs")
    hold, pids = work / "hold", work / "pids"
    hold.touch()
    pids.mkdir()
    held = write_config(work / "held", trainer=TRAINER, sidecar=SIDECAR,
                        params={"hold_file": str(hold), "pid_dir": str(pids)})
    plain = write_config(work / "plain", trainer=TRAINER, sidecar=SIDECAR)
    requeued = _submit(slurm_cluster, "train.sbatch", work, held, work / "requeued")
    return Jobs(
        requeued=requeued,
        sidecar=_submit(slurm_cluster, "sidecar.sbatch", work, plain, requeued.model_dir,  # no pid file of its own
                        f"--dependency=after:{requeued.id}", "--ntasks-per-node=2"),  # a sidecar of 2 ranks
        reference=_submit(slurm_cluster, "train.sbatch", work, plain, work / "reference"),
        two_ranks=_submit(slurm_cluster, "train_multinode.sbatch", work, plain, work / "two-ranks",
                          "--nodes=1", "--ntasks-per-node=2"),
        hold=hold, pids=pids,
    )


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its ``SigCgt`` mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def _finished(cluster: SlurmCluster, job: Job, restarts: int = 0) -> dict[str, str]:
    info = cluster.wait(job.id, timeout=TIMEOUT, restarts=restarts)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{brief(info)}\n{_output(job)}"
    return info


def _output(job: Job) -> str:
    return job.output.read_text() if job.output.exists() else "(no output yet)"


def _final_step(model_dir: Path) -> int:
    return int(json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"])


def _committed(model_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (model_dir / "checkpoints").glob("ckpt-*")
                  if (p / "MANIFEST.json").exists())


@pytest.fixture(scope="module")
def requeued(slurm_cluster: SlurmCluster, jobs: Jobs) -> tuple[dict[str, str], list[int]]:
    """The held job, signalled once its rank catches SIGUSR1, then let go; once it has been requeued,
    released and has finished: its final ``scontrol show job`` and the checkpoints it had committed
    when it was requeued."""
    job = jobs.requeued
    deadline = time.monotonic() + TIMEOUT
    pid_file = jobs.pids / "rank0"
    while not (pid_file.exists() and pid_file.read_text() and _catches(int(pid_file.read_text()), signal.SIGUSR1)):
        info = slurm_cluster.job(job.id)
        assert info["JobState"] not in FINISHED and time.monotonic() < deadline, (
            f"the job's rank never caught SIGUSR1: {brief(info)}\n{_output(job)}")
        time.sleep(0.05)
    # To the job's steps, as --signal=USR1@N does. Once it was sent, the rank runs its handler before the
    # held step goes on: the loop's end (step 4) commits.
    if not slurm_cluster.signal(job.id, signal.SIGUSR1):
        time.sleep(1.0)  # a Slurm whose slurmd does not log it: time enough
    jobs.hold.unlink()
    slurm_cluster.wait(job.id, {"PENDING"}, timeout=TIMEOUT, restarts=1)
    saved = _committed(job.model_dir)
    slurm_cluster.release(job.id)  # a requeued job waits for its BeginTime, about two minutes
    return _finished(slurm_cluster, job, restarts=1), saved


def test_usr1_saves_requeues_and_the_requeued_job_ends_bit_identical(
        slurm_cluster: SlurmCluster, jobs: Jobs, requeued: tuple[dict[str, str], list[int]]) -> None:
    info, saved = requeued
    assert info["Restarts"] == "1"
    assert saved and saved[-1] < TRAINER["train_steps"], (saved, _output(jobs.requeued))  # saved before the end
    assert _final_step(jobs.requeued.model_dir) == TRAINER["train_steps"]
    _finished(slurm_cluster, jobs.reference)
    final = f"checkpoints/ckpt-{TRAINER['train_steps']}"
    for name in ("model.safetensors", "optimizer.safetensors"):  # the same bytes: weights and optimizer state
        requeued_file, reference_file = jobs.requeued.model_dir / final / name, jobs.reference.model_dir / final / name
        assert requeued_file.read_bytes() == reference_file.read_bytes(), f"{name} differs from the uninterrupted run's"


def test_a_job_runs_to_final(slurm_cluster: SlurmCluster, jobs: Jobs) -> None:
    info = _finished(slurm_cluster, jobs.reference)
    assert info["Restarts"] == "0"
    assert _final_step(jobs.reference.model_dir) == TRAINER["train_steps"]
    assert _committed(jobs.reference.model_dir) == [8, 16, 24]


def test_the_sidecar_job_evaluates_every_checkpoint_of_the_requeued_job_once(
        slurm_cluster: SlurmCluster, jobs: Jobs, requeued: tuple[dict[str, str], list[int]]) -> None:
    _finished(slurm_cluster, jobs.sidecar)
    model_dir = jobs.requeued.model_dir
    rows = read_metrics(model_dir / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(s, "evaluated") for s in _committed(model_dir)], rows
    assert rows[-1]["step"] == TRAINER["train_steps"]
    results = [line for line in _output(jobs.sidecar).splitlines() if line.startswith('{"stop_reason"')]
    assert len(results) == 1 and json.loads(results[0])["stop_reason"] == "final"  # the chief's line alone
    assert "a sidecar of 2 ranks" in _output(jobs.sidecar)


def test_two_srun_tasks_train_as_two_ranks(slurm_cluster: SlurmCluster, jobs: Jobs) -> None:
    _finished(slurm_cluster, jobs.two_ranks)
    model_dir = jobs.two_ranks.model_dir
    assert _final_step(model_dir) == TRAINER["train_steps"]
    state = json.loads((model_dir / "checkpoints" / f"ckpt-{TRAINER['train_steps']}" / "state.json").read_text())
    assert len(state["state"]["trainer"]["rng"]) == 2  # one RNG state per rank: the job had two


def test_the_examples_are_the_scripts_these_tests_submit() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.sbatch"))
    assert scripts == ["sidecar.sbatch", "train.sbatch", "train_multinode.sbatch"]
    source = Path(__file__).read_text()
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        assert f'"{name}"' in source, f"{name} is not submitted by these tests"
        assert 'srun "$PYTHON" -m cadence' in text, name
        if name.startswith("train"):
            assert "#SBATCH --signal=USR1@" in text and "#SBATCH --requeue" in text and "--requeue\n" in text, name
