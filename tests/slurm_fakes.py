"""A stand-in for Slurm's ``scontrol`` where no Slurm runs: a real executable, put first on ``PATH``
by a test, that records each call and answers as told (:func:`fake_scontrol`); and the environment
``srun`` gives each task of a step (:func:`step_env`)."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

SCRIPT = """#!/bin/sh
# one line per call: the caller's SLURM_PROCID, the committed checkpoints under $FAKE_SCONTROL_WATCH, the arguments
manifests=$(ls "${{FAKE_SCONTROL_WATCH:-/nonexistent}}"/ckpt-*/MANIFEST.json 2>/dev/null \\
  | sed 's|.*/ckpt-||; s|/MANIFEST.json||' | tr '\\n' ',')
echo "procid=${{SLURM_PROCID:-}} committed=$manifests args=$*" >> {log}
{answer}
"""


def fake_scontrol(directory: Path, *, exit_code: int = 0, message: str = "") -> tuple[Path, Path]:
    """Write ``directory/bin/scontrol``; return ``(bin_dir, log)``: put ``bin_dir`` first on ``PATH``.
    Each call appends ``procid=R committed=S1,S2, args=ARGS`` to ``log`` (``committed``: the steps with
    a manifest under ``$FAKE_SCONTROL_WATCH``, a checkpoints dir, at the time of the call), prints
    ``message`` on stderr and exits ``exit_code``."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = directory / "scontrol.log"
    answer = (f"echo {shlex.quote(message)} >&2\n" if message else "") + f"exit {exit_code}"
    script = bin_dir / "scontrol"
    script.write_text(SCRIPT.format(log=shlex.quote(str(log)), answer=answer))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, log


def calls(log: Path) -> list[str]:
    """The lines :func:`fake_scontrol` recorded (none when it was never called)."""
    return log.read_text().splitlines() if log.exists() else []


def step_env(rank: int, ntasks: int, *, job_id: str = "4242", nodelist: str = "localhost",
             port: int | None = None) -> dict[str, str]:
    """What ``srun --ntasks NTASKS`` sets for task ``rank`` of step 0 of job ``job_id`` on one node
    (``MASTER_PORT`` only when ``port`` is given: else cadence derives it from the job id)."""
    env = {"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
           "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
           "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist,
           "SLURM_STEP_NODELIST": nodelist, "SLURM_NNODES": "1"}
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


def without_launcher_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without torchrun's and Slurm's variables (the tests' own environment may have some)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CADENCE_JOB_ID")
    return {k: v for k, v in env.items() if k not in drop and not k.startswith("SLURM_")}


__all__ = ["calls", "fake_scontrol", "step_env", "without_launcher_env"]
