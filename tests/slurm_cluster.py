"""A real one-machine Slurm for the tests: munged, slurmctld and slurmd in the foreground, children
of this process, with everything (munge key and socket, ``slurm.conf``, state, spool, logs) in one
folder of their own, so that they touch no system-wide Slurm or munge.

:func:`missing` says in one line why no cluster can start here (no binaries, not root), else None.
:class:`SlurmCluster` generates the config (``proctrack/linuxproc``, ``task/none``, no cgroups, no
accounting; one node named ``localhost`` at 127.0.0.1 with :data:`CPUS` CPUs, so that the tests'
jobs run side by side; ports that were free), starts the daemons, waits for the node to be idle and
stops everything at the end (every job cancelled first). Its :attr:`~SlurmCluster.env` points the
Slurm commands at it (``SLURM_CONF``); :meth:`~SlurmCluster.submit`, :meth:`~SlurmCluster.wait`,
:meth:`~SlurmCluster.signal` (returns once slurmd has sent it) and :meth:`~SlurmCluster.release` (a
requeued job, held about two minutes otherwise) are what the tests do with jobs. ``slurm_cluster`` is the
session-scoped fixture (tests/conftest.py provides it); ``.ci/run`` installs the Debian packages
(``slurmctld slurmd slurm-client munge``), best effort.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from cadence.cluster.launch import die_with_parent

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
CPUS = 8
"""The node's CPUs as Slurm counts them (``SlurmdParameters=config_overrides``: more than the machine
has, so that a test's jobs are not queued behind each other)."""
_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE"})
"""Job states a job does not leave (a requeued job goes back to PENDING instead)."""


def missing() -> str | None:
    """Why no cluster can start on this machine, in one line, or None when one can."""
    absent = [name for name in DAEMONS + COMMANDS if shutil.which(name, path=_PATH) is None]
    if absent:
        return (f"no Slurm here: {', '.join(absent)} not found (Debian: apt-get install slurmctld slurmd "
                "slurm-client munge)")
    if os.geteuid() != 0:
        return "Slurm's daemons need root here (SlurmUser=root) and this process is not root"
    return None


def brief(job: dict[str, str]) -> str:
    """A job (:meth:`SlurmCluster.job`) in one short line: its id, ``JobState``, ``Reason``, ``Restarts``,
    ``ExitCode``."""
    return " ".join(f"{key}={job.get(key)}" for key in ("JobId", "JobState", "Reason", "Restarts", "ExitCode"))


def _name(proc: subprocess.Popen[bytes]) -> str:
    return str(proc.args[0]) if isinstance(proc.args, list) else str(proc.args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(root: Path, ctld_port: int, slurmd_port: int) -> str:
    return "\n".join([
        "ClusterName=cadence-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=600",  # a finished job stays visible to scontrol for the tests' asserts
        "SlurmdDebug=verbose",  # logs "Sent signal N to StepId=J.S": see SlurmCluster.signal
        "KillWait=30",  # as on most clusters: a requeued run exits cleanly within it
        "SlurmdParameters=config_overrides",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class SlurmCluster:
    """A one-node Slurm cluster whose files live under ``root`` (created); :meth:`start` it, :meth:`stop` it
    (or use it as a context manager)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf), "PATH": _PATH}
        """What a process needs for the Slurm commands to reach this cluster (add it to the environment)."""
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the daemons ---------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Generates the munge key and ``slurm.conf``, starts munged, slurmctld and slurmd, and returns once
        ``sinfo`` shows the node idle; on failure stops what it started and raises ``RuntimeError`` with the
        daemons' last log lines."""
        munge = self.root / "munge"
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o711)  # munged wants its socket's folder searchable by all, writable by its owner only
        key = munge / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, env=self._env(),
                           capture_output=True)
        ctld_port = _free_port()
        slurmd_port = next(port for port in iter(_free_port, None) if port != ctld_port)
        self.conf.write_text(_conf(self.root, ctld_port, slurmd_port))
        try:
            self._daemon("munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge / 'socket'}",
                         f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                         f"--seed-file={munge / 'munged.seed'}")
            self._until(lambda: (munge / "socket").exists(), timeout, "munged did not create its socket")
            self._daemon("slurmctld", "-D", "-f", str(self.conf))
            self._daemon("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))
            self._until(self._idle, timeout, "the node did not become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Cancels every job and waits (at most ``timeout``) until none is left on the node, then ends the
        daemons (SIGTERM, SIGKILL after 10 s)."""
        if any(p.poll() is None for p in self._procs):
            jobs = self._jobs()
            if jobs:
                self.run("scancel", *map(str, jobs))
                deadline = time.monotonic() + timeout
                while self._jobs(running=True) and time.monotonic() < deadline:
                    time.sleep(0.2)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _daemon(self, *argv: str) -> None:
        with open(self.root / f"{argv[0]}.out", "wb") as log:
            self._procs.append(subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, env=self._env(), cwd=self.root,
                                                preexec_fn=die_with_parent()))

    def _until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{_name(dead[0])} exited with {dead[0].returncode}" if dead else f"{timeout:.0f} s passed"
                raise RuntimeError(f"the test Slurm cluster did not start: {what} ({why})\n{self.logs()}")
            time.sleep(0.1)

    def _idle(self) -> bool:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False).stdout.strip()
        return out == "idle"

    def logs(self, lines: int = 15) -> str:
        """The last ``lines`` lines of each daemon's output and log file."""
        parts = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")) + \
                sorted(self.root.glob("munge/*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- commands and jobs ---------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster, output captured; ``check`` raises with its output on failure."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self._env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout}")
        return proc

    def submit(self, script: Path, *options: str, env: dict[str, str] | None = None) -> int:
        """``sbatch OPTIONS... SCRIPT`` from the script's folder, with ``env`` (default: this process's
        environment, which the job inherits) plus :attr:`env`; the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                              env={**(os.environ if env is None else env), **self.env}, cwd=script.parent,
                              timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script.name}: exit {proc.returncode}: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Reason``, ``Restarts``, ``ExitCode``, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: int, states: Iterable[str] = FINISHED, timeout: float = 120.0,
             restarts: int = 0) -> dict[str, str]:
        """The job (:meth:`job`) once its state is one of ``states`` and it has been requeued at least
        ``restarts`` times; ``RuntimeError`` as soon as it has finished otherwise, ``TimeoutError`` (with
        the job and the daemons' logs) past ``timeout``."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in wanted and int(info.get("Restarts", 0)) >= restarts:
                return info
            if state in FINISHED:  # a finished job stays so
                raise RuntimeError(f"job {job_id} ended {state}, not in {sorted(wanted)} with {restarts} or more "
                                   f"restarts: {brief(info)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s: {brief(info)}\n"
                                   f"{self.logs()}")
            time.sleep(0.1)

    def signal(self, job_id: int, signum: int, timeout: float = 10.0) -> bool:
        """``scancel --signal=SIGNUM JOB``: the signal to every task of the job's steps (not to the batch
        shell), as ``--signal=SIG@SECONDS`` sends it before the time limit. Returns once slurmd has sent it
        to a step's processes (its log says so), True; False when that was not seen within ``timeout``."""
        log = self.root / "slurmd.log"
        start = log.stat().st_size if log.exists() else 0
        self.run("scancel", f"--signal={int(signum)}", str(job_id))
        sent = re.compile(rf"Sent signal {int(signum)} to StepId={job_id}\.\d+\b")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(log, "rb") as f:
                f.seek(start)
                if sent.search(f.read().decode(errors="replace")):
                    return True
            time.sleep(0.02)
        return False

    def release(self, job_id: int) -> None:
        """Lets a requeued job start now: Slurm holds it until its BeginTime (about two minutes later)."""
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def _jobs(self, running: bool = False) -> list[int]:
        argv = ["squeue", "--noheader", "--format=%A"] + (["--states=RUNNING,COMPLETING"] if running else [])
        try:
            proc = self.run(*argv, check=False, timeout=15)
        except subprocess.TimeoutExpired:
            return []
        return [int(x) for x in proc.stdout.split()] if proc.returncode == 0 else []
