"""``cadence train --nproc N``: the ranks of a job started through torch's own launcher
(``python -m torch.distributed.run``), and what every rank does at its end."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

from cadence.errors import ConfigError

if TYPE_CHECKING:
    from cadence.config import ExperimentConfig

logger = logging.getLogger("cadence")

__all__ = ["LOG_LINE_PREFIX", "end_distributed", "env_rank", "torchrun_command", "train_with_torchrun",
           "wants_torchrun"]

_TORCHRUN_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
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

    from cadence.torch.distributed import shutdown_distributed

    if not (dist.is_available() and dist.is_initialized()):
        return
    if ok:
        shutdown_distributed(barrier=True)
    elif dist.get_backend() == "gloo":
        try:
            shutdown_distributed()
        except Exception:  # best effort: the error being raised is what matters
            pass


def wants_torchrun(args: argparse.Namespace) -> bool:
    given = [f"--{name.replace('_', '-')}" for name in _TORCHRUN_FLAGS if getattr(args, name, None) is not None]
    if not given:
        return False
    if args.nproc is None:
        raise ConfigError(f"{', '.join(given)} need --nproc N (the processes to start on this machine)")
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--nproc: this process already runs under torchrun; leave --nproc and its options out")
    if args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    nnodes = 1 if args.nnodes is None else args.nnodes
    if nnodes < 1:
        raise ConfigError(f"--nnodes: must be >= 1, got {nnodes}")
    if nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {nnodes}: several machines need --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.node_rank is not None and not 0 <= args.node_rank < nnodes:
        raise ConfigError(f"--node-rank: must be in [0, {nnodes}), got {args.node_rank}")
    if args.rdzv_endpoint and ":" not in args.rdzv_endpoint:
        raise ConfigError(f"--rdzv-endpoint: expected HOST:PORT, got {args.rdzv_endpoint!r}")
    return True


def torchrun_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The launcher command of ``cadence train ... --nproc N``: ``python -m torch.distributed.run``
    with the job's layout, running ``-m cadence train`` with the other arguments in every worker."""
    nnodes = 1 if args.nnodes is None else args.nnodes
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--nnodes", str(nnodes)]
    if args.node_rank is not None:
        cmd += ["--node-rank", str(args.node_rank)]
    if nnodes == 1 and not args.rdzv_endpoint:
        cmd += ["--standalone"]  # a local rendezvous on a free port
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id:
            cmd += ["--rdzv-id", args.rdzv_id]
    # No restarts: a failed rank ends the job (the run resumes from its last checkpoint when
    # started again). --tee 3: the workers' stdout and stderr reach the console through the
    # agent, each line prefixed with its rank (the prefix applies only to tee'd streams).
    cmd += ["--max-restarts", "0", "--tee", "3"]
    worker = ["-m", "cadence", "--log-level", args.log_level, "train", args.config]
    if args.model_dir is not None:
        worker += ["--model-dir", args.model_dir]
    for text in args.overrides:
        worker += ["--set", text]
    if args.no_progress:
        worker += ["--no-progress"]
    return cmd + worker


def train_with_torchrun(args: argparse.Namespace, cfg: ExperimentConfig, console: Console) -> int:
    """Run ``cadence train`` on ``args.nproc`` processes of this machine (and more nodes) through
    ``python -m torch.distributed.run``; return the job's exit status. ``cfg`` is the config,
    already loaded once here so that a bad one fails before any process starts.

    SIGTERM / SIGHUP to this process are forwarded to the launcher, which stops the ranks."""
    cfg.require_model_dir()
    import signal
    import subprocess

    from cadence.signals import install_handlers

    cmd = torchrun_command(args)
    env = dict(os.environ)
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", LOG_LINE_PREFIX)
    # The workers write to files the agent copies out: rich would wrap their lines at 80 columns.
    env.setdefault("COLUMNS", str(max(80, shutil.get_terminal_size((130, 24)).columns - 10)))
    logger.info("starting %d processes: %s", args.nproc, " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    def forward(signum: int, _frame: Any) -> None:  # stopping cadence stops the launcher, which stops the ranks
        proc.send_signal(signum)

    forwarded = install_handlers((signal.SIGTERM, getattr(signal, "SIGHUP", None)), forward, owner="cadence train")
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
    if code != 0:
        console.print(f"[red]cadence: failed:[/red] the distributed job exited with status {code}; "
                      "torchrun's report above names the failed rank", highlight=False, soft_wrap=True)
    return code
