"""The subcommands that run training or evaluation: ``cadence train``, ``evaluate`` (one
checkpoint, ``--continuous``: the sidecar, or ``--all`` / ``--steps``: a backfill), ``launch --sidecar``
and ``sweep``.

Each takes the parsed arguments and the stderr console, and returns the exit status; a
:class:`~cadence.errors.CadenceError` is left to :func:`cadence.cli.main.main`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from rich.console import Console

from cadence import layout
from cadence.cli.sidecar import run_sidecar_here, sidecar_with_torchrun
from cadence.cli.sidecar import sidecar_done as _sidecar_done
from cadence.cli.torchrun import end_distributed, env_rank, log_restart, train_with_torchrun, wants_torchrun
from cadence.cluster import slurm
from cadence.config.schema import ExperimentConfig
from cadence.errors import ConfigError
from cadence.summaries.progress import format_logs
from cadence.summaries.scalars import json_value

logger = logging.getLogger("cadence")


def _load(args: argparse.Namespace, flags: dict[str, tuple[str, Any]] | None = None) -> ExperimentConfig:
    """The config of ``args`` (its file, ``--set`` overrides, the ``flags`` that set a config value,
    named by them in errors, and ``--model-dir``); a model dir's own ``config.yaml`` moved elsewhere
    is refused unless the model dir is given explicitly."""
    from cadence.config.loading import check_own_model_dir, load_config

    cfg = load_config(args.config, overrides=args.overrides, model_dir=args.model_dir, flags=flags)
    explicit = args.model_dir is not None or any(o.split("=", 1)[0].strip() == "model_dir" for o in args.overrides)
    if not explicit:  # a moved model dir's own config.yaml must not start a new run elsewhere
        check_own_model_dir(cfg, args.config)
    return cfg


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    if args.profile and _load(args).profiler is None:  # an override: the ranks of --nproc get it too
        args.overrides.append("profiler={}")
    if args.requeue:  # an override: the ranks of --nproc get it too
        args.overrides.append("trainer.slurm.requeue=true")
    if wants_torchrun(args):
        return train_with_torchrun(args, _claim_model_dir(args, _load(args), check=True), console)
    slurm.export_torchrun_env()  # a task of `srun --ntasks N`: a rank, as under torchrun
    rank = env_rank()
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # each node's agent counts its own restarts: a
        log_restart()  # restarted node says so even when the new rendezvous makes another node's rank 0
    if rank != 0:  # one process reports: the other ranks log warnings and errors only
        root = logging.getLogger()
        root.setLevel(max(root.getEffectiveLevel(), logging.WARNING))
    elif slurm.restart_count():
        logger.warning("Slurm requeued the job (restart %d): resuming from the latest committed checkpoint",
                       slurm.restart_count())
    cfg = _claim_model_dir(args, _load(args), check=False) if rank == 0 else _load(args)
    from cadence.cluster.roles import resolve_role
    from cadence.sidecar.evaluator import SidecarResult
    from cadence.torch.experiments.roles import train_and_evaluate

    spec = resolve_role()
    if spec.source != "default" and rank == 0:
        console.print(f"role: {spec.role} (from {spec.source})")
    import signal

    from cadence.runtime.signals import SignalHandlers, install_handlers

    handlers = SignalHandlers({})
    if spec.is_trainer and not cfg.trainer.save_on_preemption:
        # Without the preemption action SIGTERM would kill the process where it stands; raise in the
        # main thread instead, so that `with controller:` closes the run (callbacks' on_close).
        def terminate(signum: int, _frame: Any) -> None:
            signal.signal(signum, signal.SIG_IGN)  # a repeated SIGTERM does not interrupt the clean-up
            logger.warning("received SIGTERM: stopping without saving (trainer.save_on_preemption is false)")
            raise SystemExit(128 + signum)

        handlers = install_handlers([signal.SIGTERM], terminate, owner="cadence train")
    try:
        metrics = train_and_evaluate(cfg, role=spec, progress=False if args.no_progress else None)
    except BaseException:
        end_distributed(ok=False)
        raise
    finally:
        handlers.restore()
    end_distributed(ok=True)
    if isinstance(metrics, SidecarResult):  # the evaluator role ran the sidecar
        return _sidecar_done(metrics, console)
    if rank != 0:
        return 0
    shown = format_logs(metrics) or "trained (no in-process evaluation)"
    console.print(f"[bold]done[/bold]: {shown}")
    console.print(f"model dir: {cfg.model_dir}  (cadence ls {cfg.model_dir}; tensorboard --logdir {cfg.model_dir})")
    return 0


def _claim_model_dir(args: argparse.Namespace, cfg: ExperimentConfig, *, check: bool) -> ExperimentConfig:
    """Before any rank starts: with ``--take-over`` fence off the holder of the model dir's writer
    lease; else, with ``check``, refuse now (exit 2) when another trainer holds it (a fault-tolerant
    replica group: another trainer than a peer replica group, which it stands by for). First, a model
    dir this process cannot create or write (a file on its path, no permission) is refused (exit 2)."""
    from cadence.checkpoint import writer_lease
    from cadence.config.components.fault_tolerance import REPLICA_ID_ENV

    model_dir = layout.check_model_dir(cfg.require_model_dir(), writable=True)
    ft = cfg.trainer.fault_tolerance
    replica = None if ft is None else ft.replica_id if ft.replica_id is not None else os.environ.get(REPLICA_ID_ENV, "?")
    group = None if ft is None else f"group{replica}"
    if args.take_over:
        if writer_lease.take_over(model_dir) is None:
            logger.info("--take-over: nobody holds the writer lease of %s", model_dir)
    elif check:
        writer_lease.check_free(model_dir, group=group)
    return cfg


def cmd_evaluate(args: argparse.Namespace, console: Console) -> int:
    sidecar_flags = {"--mode": ("sidecar.mode", args.mode), "--timeout": ("sidecar.timeout", args.timeout),
                     "--max-evaluations": ("sidecar.max_evaluations", args.max_evaluations),
                     "--name": ("sidecar.name", args.name)}
    given = {flag: setting for flag, setting in sidecar_flags.items() if setting[1] is not None}
    if args.all or args.steps is not None:
        return _cmd_backfill(args, console, given)
    ranks = [f"--{n.replace('_', '-')}" for n in _RANKS_FLAGS if getattr(args, n, None) is not None]
    if ranks and not args.continuous:
        raise ConfigError(f"{', '.join(ranks)}: only for a sidecar of several ranks (--continuous --nproc N)")
    if args.initial and (args.continuous or args.checkpoint is not None):
        raise ConfigError("--initial evaluates no checkpoint: leave out --checkpoint and --continuous")
    if args.continuous:
        return _cmd_sidecar(args, console, given)
    if given:
        raise ConfigError(f"--mode, --timeout, --max-evaluations and --name need --continuous (--name: or --all, "
                          f"--steps) (got {', '.join(given)})")
    cfg = _load(args)
    if args.nproc is not None:
        return _evaluate_with_torchrun(args, cfg, console)
    slurm.export_torchrun_env()  # a task of `srun --ntasks N`: a rank, as under torchrun
    if env_rank() != 0:  # under torchrun one process reports: the others log warnings and errors only
        root = logging.getLogger()
        root.setLevel(max(root.getEffectiveLevel(), logging.WARNING))
    from cadence.torch.experiments.experiment import run_evaluation

    try:
        step, metrics = run_evaluation(cfg, args.checkpoint, initial=args.initial)
    except BaseException:
        end_distributed(ok=False)
        raise
    end_distributed(ok=True)  # under torchrun: a gloo group left to the interpreter's exit can abort it
    result = json.dumps({"step": step, **{k: json_value(v) for k, v in metrics.items()}})
    if env_rank() == 0:  # under torchrun: one line, from the chief
        target = os.environ.pop(_RESULT_ENV, None)
        if target:  # cadence evaluate --nproc prints it, without torchrun's rank prefix
            with open(target, "w") as f:
                f.write(result)
        else:
            print(result)
    return 0


_RANKS_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts")
"""``cadence evaluate``'s flags for a sidecar of several ranks (with ``--continuous --nproc N``)."""

_RESULT_ENV = "CADENCE_EVALUATE_RESULT"
"""Where the chief of ``cadence evaluate --nproc N`` writes its JSON line for the launcher to print."""


def _evaluate_with_torchrun(args: argparse.Namespace, cfg: Any, console: Console) -> int:
    """``cadence evaluate --nproc N``: the evaluation on N processes through torch's launcher;
    the chief's JSON line printed here."""
    import tempfile

    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--nproc: this process already runs under torchrun; leave --nproc out")
    for name in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts"):
        setattr(args, name, None)
    extra = ["--checkpoint", str(args.checkpoint)] if args.checkpoint is not None else []
    extra += ["--initial"] if args.initial else []
    fd, result = tempfile.mkstemp(prefix="cadence-evaluate-", suffix=".json")
    os.close(fd)
    try:
        code = train_with_torchrun(args, cfg, console, command="evaluate", extra=extra,
                                   env_extra={_RESULT_ENV: result})
        if code == 0:
            with open(result) as f:
                print(f.read())
    finally:
        os.unlink(result)
    return code


def _cmd_sidecar(args: argparse.Namespace, console: Console, flags: dict[str, tuple[str, Any]]) -> int:
    """``cadence evaluate --continuous``; ``flags``: the sidecar settings its flags give."""
    if args.checkpoint is not None:
        raise ConfigError("--checkpoint and --continuous exclude each other")
    cfg = _load(args, flags)
    layout.check_model_dir(cfg.require_model_dir(), writable=True)  # it writes eval/, best/, its lease: before it waits
    if wants_torchrun(args):  # --nproc N: a sidecar of N ranks
        return sidecar_with_torchrun(args, cfg, console)
    return run_sidecar_here(cfg, console)


def _cmd_backfill(args: argparse.Namespace, console: Console, flags: dict[str, tuple[str, Any]]) -> int:
    """``cadence evaluate --all`` / ``--steps``: a backfill of the evaluation ``--name``; ``flags``:
    the sidecar settings its flags give (only ``--name`` applies)."""
    selection = "--all" if args.all else "--steps"
    if args.all and args.steps is not None:
        raise ConfigError("--all and --steps exclude each other (--all: every committed checkpoint)")
    others = [flag for flag, on in (("--continuous", args.continuous), ("--checkpoint", args.checkpoint is not None),
                                    ("--initial", args.initial), ("--nproc", args.nproc is not None)) if on]
    others += [flag for flag in flags if flag != "--name"]
    others += [f"--{n.replace('_', '-')}" for n in _RANKS_FLAGS if getattr(args, n, None) is not None]
    if others:
        raise ConfigError(f"{selection} evaluates the committed checkpoints without a record, on one process, then "
                          f"stops: leave out {', '.join(others)}")
    cfg = _load(args, {flag: setting for flag, setting in flags.items() if flag == "--name"})
    from cadence.torch.experiments.experiment import run_backfill

    return _sidecar_done(run_backfill(cfg, args.steps), console)


def cmd_launch(args: argparse.Namespace, console: Console) -> int:
    if args.replicas is not None:
        from cadence.cli.launch_replicas import launch_replicas

        return launch_replicas(args, console, _load)
    if not args.sidecar:
        raise ConfigError("launch: nothing to launch; add --sidecar or --replicas R")
    cfg = _load(args)  # a bad config fails here (exit 2), before anything starts
    if args.profile and cfg.profiler is None:  # both processes get it; only the trainer traces
        args.overrides.append("profiler={}")
    model_dir = layout.check_model_dir(cfg.require_model_dir(), writable=True)  # before anything starts
    from cadence.checkpoint.leases import Leases
    from cadence.cluster.launch import launch, launch_exit_code, sidecar_commands
    from cadence.sidecar.evaluator import check_name_free, lease_holder

    check_name_free(model_dir, cfg.sidecar.name)  # another sidecar or backfill of that name runs: nothing starts
    leases = Leases(layout.checkpoints_dir(model_dir))
    holder = lease_holder(cfg.sidecar.name)

    def sidecar_ready() -> bool:  # its lease protects every checkpoint from the trainer's retention
        return any(lease.holder == holder for lease in leases.active())

    codes = launch(sidecar_commands(args.config, model_dir, args.overrides, nproc=args.nproc,
                                   sidecar_nproc=args.sidecar_nproc, progress=not args.no_progress),
                   env={"COLUMNS": "120"},
                   stop_others_on_failure=["trainer"], grace_s=args.grace,
                   start_when={"trainer": sidecar_ready})
    for name, code in codes.items():
        console.print(f"{name}: exit {code}")
    if codes.get("sidecar") == 0:
        console.print(f"evaluations: {layout.eval_dir(model_dir, cfg.sidecar.name)}/evaluations.jsonl; "
                      f"cadence ls {model_dir}")
    return launch_exit_code(codes)


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    from cadence.sweep.command import run_sweep

    return run_sweep(args)
