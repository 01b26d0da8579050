"""Slurm: a task of an ``srun`` step as a rank of a distributed job, and the job's requeue.

``srun --ntasks N cadence train ...`` starts N tasks; each gets its place from Slurm's
environment (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the step's node list and the
job id). :func:`torchrun_env` turns that into the variables torch's launcher would have set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), which the torch
runtime reads; :func:`export_torchrun_env` puts them into this process's environment.

Only a task of a step is a rank. A batch script's shell (``sbatch``) or an ``salloc`` shell has
``SLURM_JOB_ID`` (and may have ``SLURM_NTASKS`` and ``SLURM_PROCID=0``) but no step id of a
launched step: a process started there runs alone. Under torchrun (``RANK`` or ``WORLD_SIZE``
set, also ``cadence train --nproc N`` inside a Slurm job) the launcher's variables win and Slurm's
are ignored.

:func:`requeue_job` runs ``scontrol requeue JOB_ID`` (the job goes back to the queue with the same
id; ``SLURM_RESTART_COUNT`` counts the restarts). Framework-agnostic: nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from cadence.errors import ConfigError

__all__ = ["MASTER_PORT_BASE", "SlurmTask", "export_torchrun_env", "first_host", "job_env", "job_id",
           "master_port", "requeue_job", "restart_count", "slurm_task", "torchrun_env"]

logger = logging.getLogger("cadence")

MASTER_PORT_BASE = 15000
"""The rendezvous port of a Slurm job is ``MASTER_PORT_BASE + job id % 5000`` (15000-19999), the
same on every task of the job without any exchange; ``MASTER_PORT`` in the environment overrides it."""
_PORT_SPAN = 5000
_SPECIAL_STEP_IDS = 0xFFFFFFF0  # batch script, extern, interactive and pending steps: not launched tasks
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class SlurmTask:
    """This process as a task of a Slurm step: its global ``rank`` among the step's ``world_size``
    tasks, its ``local_rank`` on its node, the step's ``nodelist`` (compressed, as Slurm writes it)
    and the job's id."""

    job_id: str
    rank: int
    world_size: int
    local_rank: int
    nodelist: str

    @property
    def master_addr(self) -> str:
        """The host of rank 0: the first node of the step (:func:`first_host`)."""
        return first_host(self.nodelist)


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (set by Slurm for each task of a step)") from None


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process belongs to (``SLURM_JOB_ID``, also set in a batch script's shell);
    None outside Slurm."""
    env = os.environ if environ is None else environ
    value = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    return value or None


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset)."""
    env = os.environ if environ is None else environ
    try:
        return max(0, int(env.get("SLURM_RESTART_COUNT", "0").strip() or 0))
    except ValueError:
        return 0


def slurm_task(environ: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This process's place as a task of a Slurm step (``srun``); None when it is not one: outside
    Slurm, in a batch or ``salloc`` shell (no step id of a launched step, or no ``SLURM_PROCID``),
    or under torchrun (``RANK`` / ``WORLD_SIZE`` set: the launcher's place wins).

    Raises:
      ConfigError: a Slurm variable that is not an integer, or a rank outside ``[0, SLURM_NTASKS)``.
    """
    env = os.environ if environ is None else environ
    if any(env.get(name, "").strip() for name in _TORCHRUN_VARS):
        return None
    job = job_id(env)
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    if job is None or not step.isdigit() or int(step) >= _SPECIAL_STEP_IDS:  # no launched step: not a rank
        return None
    rank = _int(env, "SLURM_PROCID")
    if rank is None:
        return None
    world = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_STEP_NUM_TASKS") or 1
    local = _int(env, "SLURM_LOCALID") or 0
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"SLURM_PROCID={rank} is not in [0, SLURM_NTASKS={world})")
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                or "").strip()
    return SlurmTask(job_id=job, rank=rank, world_size=world, local_rank=max(local, 0), nodelist=nodelist)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list, as ``scontrol show hostnames`` lists it first:
    ``node[03-05,9],gpu1`` -> ``node03``, ``a,b`` -> ``a``, ``rack[1-2]-n[4-5]`` -> ``rack1-n4``. A form
    this does not read is expanded by ``scontrol show hostnames`` when it is on ``PATH``.

    Raises:
      ConfigError: an empty list, or one neither this nor ``scontrol`` reads.
    """
    text = nodelist.strip()
    if not text:
        raise ConfigError("SLURM_JOB_NODELIST is empty: no host for rank 0 (set MASTER_ADDR)")
    host = _first_host(text)
    if host is None:
        host = _scontrol_first_host(text)
    if host is None:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot tell its first host (set MASTER_ADDR)")
    return host


_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE_START = re.compile(r"^\s*([0-9]+)(?:\s*-\s*[0-9]+)?\s*$")


def _first_host(text: str) -> str | None:
    depth, end = 0, len(text)
    for i, char in enumerate(text):  # the first item: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            return None
        if char == "," and depth == 0:
            end = i
            break
    item = text[:end].strip()
    if depth != 0 or not item:
        return None

    def first(match: re.Match[str]) -> str:
        start = _RANGE_START.match(match.group(1).split(",", 1)[0])
        if start is None:
            raise ValueError(match.group(0))
        return start.group(1)  # zero padding kept: node[01-04] -> node01

    try:
        host = _BRACKET.sub(first, item)
    except ValueError:
        return None
    return None if any(c in host for c in "[],") else host


def _scontrol_first_host(text: str) -> str | None:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    import subprocess

    try:
        done = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def master_port(job: str) -> int:
    """The rendezvous port of job ``job``: ``MASTER_PORT_BASE + id % 5000`` (the digits of the id)."""
    digits = re.sub(r"\D", "", job)
    return MASTER_PORT_BASE + (int(digits) if digits else 0) % _PORT_SPAN


def torchrun_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables torch's launcher sets, for a task of a Slurm step of several tasks: ``RANK``
    (``SLURM_PROCID``), ``WORLD_SIZE`` (``SLURM_NTASKS``), ``LOCAL_RANK`` (``SLURM_LOCALID``),
    ``MASTER_ADDR`` (the step's first node, unless set) and ``MASTER_PORT`` (:func:`master_port`,
    unless set). ``{}`` for anything else: a single task is a plain one-process run, and outside a
    step (see :func:`slurm_task`) nothing changes.

    Raises:
      ConfigError: as :func:`slurm_task`, or a node list without a readable first host.
    """
    env = os.environ if environ is None else environ
    task = slurm_task(env)
    if task is None or task.world_size == 1:
        return {}
    return {"RANK": str(task.rank), "WORLD_SIZE": str(task.world_size), "LOCAL_RANK": str(task.local_rank),
            "MASTER_ADDR": env.get("MASTER_ADDR", "").strip() or task.master_addr,
            "MASTER_PORT": env.get("MASTER_PORT", "").strip() or str(master_port(task.job_id))}


def job_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``CADENCE_JOB_ID=slurm-<SLURM_JOB_ID>`` inside a Slurm job when ``CADENCE_JOB_ID`` is unset:
    the job's id names the writer of its model dir, so a requeued job (same id) takes over the
    writer lease of its killed run at once, on whatever node it lands. ``{}`` otherwise."""
    env = os.environ if environ is None else environ
    job = job_id(env)
    if job is None or env.get("CADENCE_JOB_ID", "").strip():
        return {}
    return {"CADENCE_JOB_ID": f"slurm-{job}"}


def export_torchrun_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put :func:`torchrun_env` and :func:`job_env` into ``environ`` (default: this process's
    environment, which child processes inherit); return what was set. Idempotent: once set, the
    launcher's variables are there and nothing more changes."""
    env = os.environ if environ is None else environ
    values = {**torchrun_env(env), **job_env(env)}
    env.update(values)
    if "RANK" in values:
        logger.debug("a task of Slurm job %s: rank %s of %s, rendezvous at %s:%s", env.get("SLURM_JOB_ID"),
                     values["RANK"], values["WORLD_SIZE"], values["MASTER_ADDR"], values["MASTER_PORT"])
    return values


def requeue_job(job: str, *, timeout_s: float = 60.0) -> str | None:
    """Run ``scontrol requeue JOB``: Slurm puts the job back in the queue (same id) and ends its
    processes. None when it did; else why not, in one line (``scontrol`` missing, its exit status
    and error, or no answer within ``timeout_s``)."""
    import subprocess

    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return "scontrol is not on PATH"
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"scontrol requeue {job} did not answer within {timeout_s:g} s"
    except OSError as e:
        return f"scontrol requeue {job} could not run: {e}"
    if done.returncode != 0:
        said = " ".join((done.stderr.strip() or done.stdout.strip()).split()) or "no message"
        return f"scontrol requeue {job} exited with status {done.returncode}: {said}"
    return None
