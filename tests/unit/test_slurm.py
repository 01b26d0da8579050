"""Slurm without a Slurm: a step's environment read as a rank (:mod:`cadence.cluster.slurm`, and the
torch runtime's ``rank_env`` on it), and the requeue after a preemption save, decided by
``SaveCheckpointIfPreempted`` with the real Controller and CheckpointManager and real signals. The
``scontrol`` it runs is a real executable first on ``PATH`` (tests/slurm_fakes.py) that records
each call and which checkpoints were committed when it came."""

from __future__ import annotations

import functools
import logging
import os
import signal
from pathlib import Path

import pytest

from cadence import Controller
from cadence.actions import SaveCheckpointIfPreempted
from cadence.checkpoint import CheckpointManager
from cadence.cluster import slurm
from cadence.config import ExperimentConfig
from cadence.errors import ConfigError
from fakes import FakeTrainer
from slurm_fakes import calls, fake_scontrol, step_env

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
JOB = "4242"


@pytest.fixture(autouse=True)
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------ a step's task as a rank


def test_a_task_of_a_two_task_step_gets_torchruns_variables():
    env = step_env(1, 2, job_id="123457", nodelist="node[07-09],gpu1")
    assert slurm.torchrun_env(env) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                       "MASTER_ADDR": "node07", "MASTER_PORT": str(15000 + 123457 % 5000)}
    # MASTER_ADDR / MASTER_PORT given: kept
    given = slurm.torchrun_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"})
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.1", "29555")
    # the job's node list when the step's is missing
    job_only = {k: v for k, v in env.items() if k != "SLURM_STEP_NODELIST"}
    assert slurm.torchrun_env({**job_only, "SLURM_JOB_NODELIST": "a,b"})["MASTER_ADDR"] == "a"


@pytest.mark.parametrize("env", [
    pytest.param({}, id="outside-slurm"),
    pytest.param({"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                  "SLURM_JOB_NODELIST": "localhost"}, id="batch-shell"),
    pytest.param({**step_env(0, 2), "SLURM_STEP_ID": "4294967291", "SLURM_STEPID": "4294967291"},
                 id="batch-step-id"),
    pytest.param({**step_env(0, 2), "SLURM_STEP_ID": "-5", "SLURM_STEPID": "-5"}, id="negative-step-id"),
    pytest.param({**step_env(0, 2), "SLURM_STEP_ID": "batch", "SLURM_STEPID": "batch"}, id="named-step"),
    pytest.param(step_env(0, 1), id="single-task"),
    pytest.param({**step_env(1, 2), "RANK": "0", "WORLD_SIZE": "2"}, id="under-torchrun"),
])
def test_what_is_not_a_rank_of_a_slurm_step_changes_nothing(env):
    assert slurm.torchrun_env(env) == {}
    mutable = dict(env)
    assert slurm.export_torchrun_env(mutable) == ({"CADENCE_JOB_ID": f"slurm-{JOB}"} if "SLURM_JOB_ID" in env else {})
    assert {k: mutable[k] for k in env} == env


def test_export_sets_the_variables_once_and_names_the_job():
    env = step_env(0, 2)
    assert slurm.export_torchrun_env(env)["RANK"] == "0"
    assert env["CADENCE_JOB_ID"] == f"slurm-{JOB}" and env["WORLD_SIZE"] == "2"
    assert slurm.export_torchrun_env(env) == {}  # the launcher's variables are there now
    assert slurm.job_env({**step_env(0, 2), "CADENCE_JOB_ID": "mine"}) == {}


@pytest.mark.parametrize(("nodelist", "host"), [
    ("localhost", "localhost"), ("a,b", "a"), ("node[1-3,5]", "node1"), ("node[03-05,9],gpu1", "node03"),
    ("rack[1-2]-n[4-5]", "rack1-n4"), ("gpu[7],cpu[1-2]", "gpu7"), (" h1 ", "h1"),
])
def test_first_host_of_a_node_list(nodelist, host):
    assert slurm.first_host(nodelist) == host


def test_bad_slurm_values_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol to ask
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST='node\[1-3'.*MASTER_ADDR"):
        slurm.torchrun_env(step_env(0, 2, nodelist="node[1-3"))
    with pytest.raises(ConfigError, match=r"SLURM_PROCID=2 is not in \[0, SLURM_NTASKS=2\)"):
        slurm.torchrun_env(step_env(2, 2))
    with pytest.raises(ConfigError, match="SLURM_NTASKS='two' is not an integer"):
        slurm.torchrun_env({**step_env(0, 2), "SLURM_NTASKS": "two"})


def test_the_torch_runtime_reads_a_slurm_task_as_its_rank():
    from cadence.torch.runtime.distributed import rank_env

    assert rank_env({**step_env(1, 3), "SLURM_LOCALID": "0"}) == (1, 3, 0)
    assert rank_env({"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "3", "SLURM_PROCID": "0"}) == (0, 1, 0)  # batch shell


def test_restart_count():
    assert slurm.restart_count({}) == 0
    assert slurm.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2


# ------------------------------------------------------------------ the requeue after a preemption save


def kill(sig: int) -> None:
    os.kill(os.getpid(), sig)


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A fake ``scontrol`` first on PATH that accepts; its log."""
    bin_dir, log = fake_scontrol(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_SCONTROL_WATCH", str(tmp_path / "checkpoints"))
    return log


def train(tmp_path: Path, kill_at: int, sig: int, *, steps: int = 30) -> tuple[FakeTrainer, int | str | None]:
    """Train ``steps`` in loops of 3 with a requeueing preemption action; ``sig`` at step ``kill_at``.
    The trainer and the exit code (None: no exit)."""
    trainer = FakeTrainer(on_step={kill_at: lambda: kill(sig)})
    action = SaveCheckpointIfPreempted(requeue=functools.partial(slurm.requeue_job, JOB), final_step=steps)
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=None)
    controller = Controller(trainer=trainer, checkpoint_manager=manager, steps_per_loop=3, checkpoint_interval=100,
                            train_actions=[action], progress=False)
    code: int | str | None = None
    try:
        controller.train(steps)
    except SystemExit as e:
        code = e.code
    finally:
        controller.close()
    return trainer, code


def test_sigusr1_saves_then_the_chief_requeues_once_and_exits_zero(tmp_path, scontrol, caplog):
    with caplog.at_level(logging.WARNING, logger="cadence"):
        trainer, code = train(tmp_path, 7, signal.SIGUSR1)
    assert (code, trainer.global_step) == (0, 9)
    assert calls(scontrol) == [f"procid= committed=9, args=requeue {JOB}"]  # once, after the commit of step 9
    assert "requeued the job: it resumes from the checkpoint at step 9" in caplog.text
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # the scheduler's SIGTERM is ignored


def test_sigterm_saves_and_exits_without_a_requeue(tmp_path, scontrol):
    trainer, code = train(tmp_path, 7, signal.SIGTERM)
    assert (code, trainer.global_step) == (0, 9)
    assert calls(scontrol) == []
    assert (tmp_path / "checkpoints" / "ckpt-9" / "MANIFEST.json").exists()


def test_a_run_at_its_last_step_is_not_requeued(tmp_path, scontrol, caplog):
    with caplog.at_level(logging.WARNING, logger="cadence"):
        trainer, code = train(tmp_path, 11, signal.SIGUSR1, steps=12)
    assert (code, trainer.global_step) == (0, 12)
    assert calls(scontrol) == []
    assert "not requeueing the job: training reached its last step (12)" in caplog.text


@pytest.mark.parametrize("exit_code", [1, None], ids=["refused", "no-scontrol"])
def test_a_refused_requeue_is_one_warning_line_and_exit_zero(tmp_path, monkeypatch, caplog, exit_code):
    if exit_code is None:
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        said = "scontrol is not on PATH"
    else:
        bin_dir, _ = fake_scontrol(tmp_path / "fake", exit_code=1,
                                   message="scontrol: error: Requeue of JobId=4242 is disabled\nsecond line")
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        said = (f"scontrol requeue {JOB} exited with status 1: scontrol: error: Requeue of JobId=4242 is disabled "
                "second line")
    with caplog.at_level(logging.WARNING, logger="cadence"):
        trainer, code = train(tmp_path, 7, signal.SIGUSR1)
    assert (code, trainer.global_step) == (0, 9)
    lines = [r.getMessage() for r in caplog.records if "received SIGUSR1" not in r.getMessage()]
    assert lines == [f"the job was not requeued ({said}); resubmit the same batch script (sbatch ...) to resume from "
                     "the checkpoint at step 9"]


# ------------------------------------------------------------------ the config


def test_requeue_needs_save_on_preemption_and_warns_outside_slurm(tmp_path, monkeypatch, caplog):
    from cadence.torch.experiments.actions import build_actions

    base = {"task": {"class": "x:Y"}, "model_dir": str(tmp_path / "run")}
    with pytest.raises(ValueError, match="trainer.slurm.requeue needs trainer.save_on_preemption"):
        ExperimentConfig.model_validate({**base, "trainer": {"slurm": {"requeue": True}, "save_on_preemption": False}})
    cfg = ExperimentConfig.model_validate({**base, "trainer": {"slurm": {"requeue": True}, "train_steps": 5}})
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        (outside,), _ = build_actions(cfg, None, None, train=True, evaluate=False)  # type: ignore[arg-type]
    assert outside.requeue is None and "not in a Slurm job (SLURM_JOB_ID is not set)" in caplog.text
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    (inside,), _ = build_actions(cfg, None, None, train=True, evaluate=False)  # type: ignore[arg-type]
    assert inside.requeue is not None and inside.final_step == 5
