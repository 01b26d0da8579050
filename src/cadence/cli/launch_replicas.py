"""``cadence launch CONFIG --replicas R [--nproc N]``: the command's checks, then the replica groups
(:mod:`cadence.cluster.replica_groups`), each a ``cadence train`` job of one process or of ``--nproc N``.
Refused with one line (exit 2): ``--sidecar`` with it, ``--replicas`` < 1 (the flag's bound), a config
that does not validate with R groups, a model dir that is not writable, and a lighthouse that does
not start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console

from cadence import layout
from cadence.cluster.launch import launch_exit_code
from cadence.config.schema import ExperimentConfig
from cadence.errors import ConfigError

__all__ = ["launch_replicas"]


def launch_replicas(args: argparse.Namespace, console: Console,
                    load: Callable[[argparse.Namespace], ExperimentConfig]) -> int:
    """Run ``args.replicas`` fault-tolerant replica groups of ``args.config``; the launcher's exit
    status (0 when every group ended with 0). ``load``: the command line's config loader (its
    file, ``--set`` overrides and ``--model-dir``)."""
    from cadence.cluster.replica_groups import free_port, group_commands, lighthouse_program, run_replica_groups

    replicas = int(args.replicas)
    if args.sidecar:
        raise ConfigError("launch: --replicas and --sidecar do not go together yet")
    port = free_port()
    lighthouse = f"http://127.0.0.1:{port}"
    overrides = list(args.overrides)
    own = [f"trainer.fault_tolerance.replica_groups={replicas}", "trainer.fault_tolerance.replica_id=0",
           f"trainer.fault_tolerance.lighthouse={lighthouse}"]
    args.overrides = overrides + own
    try:
        cfg = load(args)  # a bad config (or one that does not fit R groups) fails here, before anything starts
    finally:
        args.overrides = overrides
    ft = cfg.trainer.fault_tolerance
    assert ft is not None
    model_dir = layout.check_model_dir(cfg.require_model_dir(), writable=True)
    argv = [lighthouse_program(), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(ft.min_replicas),
            "--join_timeout_ms", str(round(ft.join_timeout_s * 1000)), "--quorum_tick_ms", "100",
            "--heartbeat_timeout_ms", str(round(ft.heartbeat_timeout_s * 1000))]
    commands = group_commands(args.config, model_dir, replicas, lighthouse, overrides, sys.executable,
                              progress=not args.no_progress, nproc=args.nproc or 1)
    log = Path(model_dir) / layout.REPLICAS / "lighthouse.log"
    codes = run_replica_groups(commands, argv, port, log, max_restarts=args.max_restarts, grace_s=args.grace)
    restarts = codes.pop("restarts")
    for name, code in codes.items():
        console.print(f"{name}: exit {code}")
    console.print(f"restarts: {restarts}; checkpoints: cadence ls {model_dir}")
    return launch_exit_code(codes)

