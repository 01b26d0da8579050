"""``cadence train --nproc N``: the ranks of a job started through torch's own launcher
(``torch.distributed.run``), and what every rank does at its end.

The launcher runs as ``python -m cadence.cli.torchrun_agent TORCHRUN_ARGS...``: torch's own ``main``, in a
process that also records, when the job gives up (a rank failed and ``--max-restarts`` are used
up), which ranks failed and how, for ``cadence train`` to say so in its one-line error."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Sequence

from rich.console import Console
from rich.markup import escape

from cadence.cli.node_loss import LOST_ENV, lost_message, read_lost
from cadence.errors import ConfigError
from cadence.runtime.watchdog import HANG_EXIT_CODE

if TYPE_CHECKING:
    from cadence.config import ExperimentConfig

logger = logging.getLogger("cadence")

__all__ = ["ERRORS_ENV", "LOG_LINE_PREFIX", "REPORT_ENV", "bad_input", "end_distributed", "end_rank_now", "env_rank",
           "failure_message", "log_restart", "record_for_launcher", "torchrun_command", "train_with_torchrun",
           "wants_torchrun"]

_TORCHRUN_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts")
REPORT_ENV = "CADENCE_TORCHRUN_REPORT"
"""Where the launcher (``python -m cadence.cli.torchrun_agent``) writes the failed ranks of a job that gave up
(JSON); set by :func:`train_with_torchrun`, removed from the environment the workers get."""

ERRORS_ENV = "CADENCE_TORCHRUN_ERRORS"
"""Set (``1``) by :func:`train_with_torchrun` for the ranks: a rank ended by bad input (exit 2) leaves
its one line to ``cadence train`` to print once for the job (:func:`record_for_launcher`)."""

RESUMES = "from its last checkpoint"
"""Where a restarted training job resumes, as :func:`failure_message` says it."""

LOG_LINE_PREFIX = "[rank${rank}]:"
"""Each worker's output lines are prefixed with its global rank (torchrun's
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``; torch 2.13's launcher has no command-line flag for it)."""


def env_rank() -> int:
    """This process's global rank from `$RANK` (0 outside a distributed job)."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def end_distributed(ok: bool) -> None:
    """Close this rank's process group before it exits: a gloo group left to the interpreter's
    exit can abort the process (SIGABRT, which would then hide the real exit status).

    ``ok``: the work ended normally, so wait for the other ranks first. After an error, close
    it at once (the others may never arrive), and only a gloo group (a local operation)."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    from cadence.torch.runtime import heartbeat
    from cadence.torch.runtime.distributed import shutdown_distributed

    if not ok:  # several nodes: this rank, once silent, has ended on an error, not been lost
        heartbeat.mark_ended()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if ok:
        shutdown_distributed(barrier=True)
    elif dist.get_backend() == "gloo":
        try:
            shutdown_distributed()
        except Exception:  # best effort: the error being raised is what matters
            pass


def record_for_launcher(message: str) -> bool:
    """In a rank of a torchrun job ended by bad input (exit 2): write ``message`` to torchrun's error
    file (``$TORCHELASTIC_ERROR_FILE``, in the format of torch's ``@record``), where the launcher's
    report of the failure shows it. True when ``cadence train`` prints it for the job (:data:`ERRORS_ENV`):
    the rank need not print it too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path:
        return False
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": "",
                                                                     "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        return False
    return os.environ.get(ERRORS_ENV) == "1"


def end_rank_now(code: int) -> NoReturn:
    """End this rank of a torchrun job at once with exit status ``code``, its output flushed, without
    the interpreter's teardown (seconds with torch loaded): for an error every rank raised together
    (:attr:`~cadence.errors.CadenceError.every_rank`). The ranks of every node then end within moments
    of each other; else the agent that hosts the job's rendezvous store could exit with its own ranks
    while another node's rank is still tearing down, and that node's agent fail on the vanished store."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def bad_input(failures: list[dict[str, Any]]) -> str | None:
    """The one line of a job ended by bad input: a rank exited with status 2 and recorded its message
    (:func:`record_for_launcher`), and every other failed rank exited 2 too or was stopped by a signal
    (the launcher stops the rest); else None."""
    if not all(f["exitcode"] == 2 or f["exitcode"] < 0 for f in failures):
        return None
    return next((f["message"] for f in failures if f["exitcode"] == 2 and isinstance(f.get("message"), str)), None)


def wants_torchrun(args: argparse.Namespace) -> bool:
    given = [f"--{name.replace('_', '-')}" for name in _TORCHRUN_FLAGS if getattr(args, name, None) is not None]
    if not given:
        return False
    if args.nproc is None:
        raise ConfigError(f"{', '.join(given)} need --nproc N (the processes to start on this machine)")
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--nproc: this process already runs under torchrun; leave --nproc and its options out")
    nnodes = 1 if args.nnodes is None else args.nnodes  # its range and --nproc's: cadence.cli.flags
    if nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {nnodes}: several machines need --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.node_rank is not None and not 0 <= args.node_rank < nnodes:
        raise ConfigError(f"--node-rank: must be in [0, {nnodes}), got {args.node_rank}")
    if args.rdzv_endpoint and ":" not in args.rdzv_endpoint:
        raise ConfigError(f"--rdzv-endpoint: expected HOST:PORT, got {args.rdzv_endpoint!r}")
    rdzv_conf = getattr(args, "rdzv_conf", None)
    if rdzv_conf is not None:
        if not args.rdzv_endpoint:
            raise ConfigError("--rdzv-conf: configures the c10d rendezvous of --rdzv-endpoint HOST:PORT; give both")
        bad = [item for item in rdzv_conf.split(",") if not item.partition("=")[0].strip() or "=" not in item]
        if bad:
            raise ConfigError(f"--rdzv-conf: expected KEY=VALUE[,KEY=VALUE...], got {bad[0]!r}")
    return True


def _max_restarts(args: argparse.Namespace) -> int:
    value = getattr(args, "max_restarts", None)
    return 0 if value is None else value


def torchrun_command(args: argparse.Namespace, python: str = sys.executable, *,
                     command: str = "train", extra: Sequence[str] = ()) -> list[str]:
    """The launcher command of ``cadence train ... --nproc N``: torch's launcher (``torch.distributed.run``,
    through ``python -m cadence.cli.torchrun_agent``) with the job's layout and ``--max-restarts``, running
    ``-m cadence train`` with the other arguments in every worker."""
    nnodes = 1 if args.nnodes is None else args.nnodes
    cmd = [python, "-m", "cadence.cli.torchrun_agent", "--nproc-per-node", str(args.nproc), "--nnodes", str(nnodes)]
    if args.node_rank is not None:
        cmd += ["--node-rank", str(args.node_rank)]
    if nnodes == 1 and not args.rdzv_endpoint:
        cmd += ["--standalone"]  # a local rendezvous on a free port
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id:
            cmd += ["--rdzv-id", args.rdzv_id]
        if getattr(args, "rdzv_conf", None):
            cmd += ["--rdzv-conf", args.rdzv_conf]
    # --max-restarts K: a failed rank (killed, crashed, ended by its hang watchdog) makes the agent
    # stop the others and start the whole group again, up to K times; each start resumes from the
    # latest committed checkpoint. 0 (the default): a failed rank ends the job. --tee 3: the
    # workers' stdout and stderr reach the console through the agent, each line prefixed with its
    # rank (the prefix applies only to tee'd streams).
    cmd += ["--max-restarts", str(_max_restarts(args)), "--tee", "3"]
    worker = ["-m", "cadence", "--log-level", args.log_level, command, args.config]
    if args.model_dir is not None:
        worker += ["--model-dir", args.model_dir]
    for text in args.overrides:
        worker += ["--set", text]
    if getattr(args, "no_progress", False):
        worker += ["--no-progress"]
    return cmd + worker + list(extra)


def train_with_torchrun(args: argparse.Namespace, cfg: ExperimentConfig, console: Console, *,
                        command: str = "train", extra: Sequence[str] = (),
                        env_extra: Mapping[str, str] | None = None, resumes: str = "") -> int:
    """Run ``cadence train`` on ``args.nproc`` processes of this machine (and more nodes) through
    torch's launcher (:func:`torchrun_command`); return the job's exit status. ``cfg`` is the
    config, already loaded once here so that a bad one fails before any process starts. A failed
    job ends with one line naming the rank that failed first and how (:func:`failure_message`;
    ``resumes``: where a restarted job resumes, in it).

    SIGTERM / SIGHUP to this process are forwarded to the launcher, which stops the ranks."""
    cfg.require_model_dir()
    import subprocess

    from cadence.runtime.signals import install_handlers

    cmd = torchrun_command(args, command=command, extra=extra)
    env = dict(os.environ)
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", LOG_LINE_PREFIX)
    # The workers write to files the agent copies out: rich would wrap their lines at 80 columns.
    env.setdefault("COLUMNS", str(max(80, shutil.get_terminal_size((130, 24)).columns - 10)))
    # Each start of the group gets a fresh TCPStore, hosted by its rank 0: in the agent's store,
    # which outlives the workers, a restarted group finds the keys of the previous one and can hang
    # in init_process_group (pytorch/pytorch#135712). A fault-tolerant replica group that torchrun
    # does not restart (its launcher starts a new job) keeps the agent's store: rank 0 would bind a
    # port the agent found free seconds before, which another group starting beside it can take
    # first (EADDRINUSE, seen with two groups of 2 ranks); torchft's Manager shares that store too.
    shared = cfg.trainer.fault_tolerance is not None and _max_restarts(args) == 0
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0" if shared else "1")
    # torch's launcher sets OMP_NUM_THREADS=1 for each rank when it is unset and a node runs several,
    # with a five-line banner: set here as it would be (the same threads), without the banner
    threads = "" if "OMP_NUM_THREADS" in env or args.nproc < 2 else env.setdefault("OMP_NUM_THREADS", "1")
    fd, report = tempfile.mkstemp(prefix="cadence-torchrun-", suffix=".json")
    os.close(fd)
    env[REPORT_ENV] = report
    lost = env[LOST_ENV] = report + ".lost"  # created by the rank that finds a node lost (node_loss)
    if args.node_rank is not None:  # the node as the user numbered it (c10d's rendezvous numbers its own)
        env["CADENCE_NODE_RANK"] = str(args.node_rank)
    env[ERRORS_ENV] = "1"
    env.update(env_extra or {})
    logger.info("starting %d processes%s: %s", args.nproc,
                f" (OMP_NUM_THREADS={threads} each, as torchrun sets it; set OMP_NUM_THREADS to change it)"
                if threads else "", " ".join(cmd))
    try:
        proc = subprocess.Popen(cmd, env=env)

        def forward(signum: int, _frame: Any) -> None:  # stopping cadence stops the launcher, which stops the ranks
            proc.send_signal(signum)

        forwarded = install_handlers((signal.SIGTERM, getattr(signal, "SIGHUP", None)), forward,
                                     owner="cadence train")
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # the terminal's SIGINT reached the launcher too; let it stop the ranks
            try:
                code = proc.wait(timeout=60)
            except (KeyboardInterrupt, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            raise
        finally:
            forwarded.restore()
        failures = _read_report(report)
        finding = read_lost(lost)
    finally:
        for path in (report, lost):
            try:
                os.unlink(path)
            except OSError:
                pass
    message = bad_input(failures) if code == 2 else None
    if message is not None:  # the ranks' own one line (the launcher exited 2 for it), printed once
        console.print(f"[red]cadence: error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    elif code != 0:
        message = failure_message(code, failures, _max_restarts(args), lost=finding, resumes=resumes)
        console.print(f"[red]cadence: failed:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return code


def restarts() -> tuple[int, int]:
    """In a worker of a torchrun job: ``(restart, max_restarts)``, this node's agent's count of the
    job's restarts so far (``TORCHELASTIC_RESTART_COUNT``) and its ``--max-restarts``; ``(0, 0)``
    outside torchrun or when they cannot be read."""
    try:
        return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))
    except ValueError:
        return 0, 0


def log_restart() -> None:
    """In a worker of a torchrun job that restarted (:func:`restarts`): say so, once per node (each
    node's local rank 0 calls it)."""
    count, limit = restarts()
    if count > 0:
        logger.warning("torchrun restarted the job after a failure (restart %d of --max-restarts %d): resuming "
                       "from the latest committed checkpoint", count, limit)


def _read_report(path: str) -> list[dict[str, Any]]:
    """The failed ranks the launcher recorded (see :func:`cadence.cli.torchrun_agent.launcher_main`); [] when none were."""
    try:
        with open(path) as f:
            text = f.read()
        failures = json.loads(text)["failures"] if text.strip() else []
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f for f in failures if isinstance(f, dict) and isinstance(f.get("rank"), int)
            and isinstance(f.get("exitcode"), int)] if isinstance(failures, list) else []


def _how(failure: dict[str, Any]) -> str:
    """How one rank ended: killed by a signal, ended by its hang watchdog, or an exit status."""
    code = failure["exitcode"]
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == HANG_EXIT_CODE:
        return (f"was ended by its hang watchdog (exit status {code}: no progress for trainer.hang_timeout "
                "seconds; where it was stuck is logged above)")
    message = failure.get("message")  # a rank's bad input it left to cadence to print (record_for_launcher)
    return f"exited with status {code}" + (f" ({message})" if isinstance(message, str) else "")


def failure_message(code: int, failures: list[dict[str, Any]], max_restarts: int,
                    lost: dict[str, Any] | None = None, resumes: str = "") -> str:
    """``cadence train --nproc N``'s one-line error: the rank that failed first and how, the
    others that failed with it, and the restarts used up; without a report (the launcher itself
    failed, e.g. at the rendezvous) the launcher's exit status. ``lost``: the ranks of other nodes that a
    failed rank found had stopped answering (:mod:`cadence.cli.node_loss`): then the lost node and its
    ranks are named instead of this node's ranks, which failed because of it. ``resumes``: where a
    restarted job resumes (default :data:`RESUMES`)."""
    if not failures:
        return (f"the distributed job exited with status {code}; torchrun's report above names the failed "
                "rank")
    first, *others = failures
    details = ", ".join(f"{label} {first[key]}" for key, label in (("local_rank", "local rank"), ("pid", "pid"))
                        if isinstance(first.get(key), int))
    text = f"rank {first['rank']}" + (f" ({details})" if details else "") + f" {_how(first)}"
    if others:
        text += "; also ended: " + ", ".join(f"rank {f['rank']} ({_short(f)})" for f in others)
    text = lost_message(lost, failures) or text
    if max_restarts == 0:
        text += f"; the job was not restarted (--max-restarts 0; --max-restarts K restarts it {resumes or RESUMES})"
    else:
        times = "once" if max_restarts == 1 else f"{max_restarts} times"
        text += f"; the job was restarted {times} already (--max-restarts {max_restarts}, all used)"
    return text


def _short(failure: dict[str, Any]) -> str:
    code = failure["exitcode"]
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"hang watchdog, exit {code}" if code == HANG_EXIT_CODE else f"exit {code}"
