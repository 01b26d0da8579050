"""The ``cadence`` command.

    cadence train CONFIG [--model-dir DIR] [--set key=value ...] [--nproc N [--max-restarts K] [--nnodes M ...]]
    cadence evaluate CONFIG --model-dir DIR [--checkpoint STEP] [--set key=value ...]
    cadence evaluate CONFIG --model-dir DIR --continuous [--mode every|latest] [--timeout S] ...
    cadence export MODEL_DIR [--checkpoint best|latest|STEP] --format FORMAT [--out DIR]
    cadence launch CONFIG --sidecar [--model-dir DIR] [--set key=value ...]
    cadence smoke CONFIG [--set key=value ...] [--steps N] [--keep DIR]
    cadence ls MODEL_DIR
    cadence report MODEL_DIR [--out PATH]      (needs matplotlib: pip install 'cadence[report]')
    cadence sweep CONFIG --space SPACE.yaml --trials N [--parallel K] [--sweep-dir DIR] [--sidecar] [--set ...]
    cadence ls SWEEP_DIR / cadence report SWEEP_DIR   (a sweep's trials; needs optuna: pip install 'cadence[sweep]')

Exit status: 0 success; 1 a run failed (the message says why); 2 bad input (config, override,
arguments) -- one readable line naming the offending field, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import sysconfig
from typing import Any, Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from cadence import __version__, layout
from cadence.config.schema import EXPORT_FORMATS, ExperimentConfig
from cadence.errors import CadenceError, ConfigError
from cadence.summaries.progress import format_value
from cadence.summaries.scalars import json_value
from cadence.cli.torchrun import (  # noqa: F401  (torchrun_command: part of the CLI's API)
    end_distributed,
    env_rank,
    log_restart,
    torchrun_command,
    train_with_torchrun,
    wants_torchrun,
)

logger = logging.getLogger("cadence")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence", description="Train, evaluate and checkpoint PyTorch models in loops."
    )
    parser.add_argument("--version", action="version", version=f"cadence {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_config_args(p: argparse.ArgumentParser, model_dir_required: bool) -> None:
        p.add_argument("config", help="experiment config (YAML)")
        p.add_argument("--model-dir", required=model_dir_required,
                       help="model directory (overrides model_dir in the config)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set trainer.train_steps=100; "
                            "name[N] is a list item: callbacks[0].params.x=1 (repeatable)")

    train = sub.add_parser("train", help="train and evaluate (resumes from the model dir); --nproc N: on N processes")
    add_config_args(train, model_dir_required=False)
    train.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    train.add_argument("--take-over", action="store_true",
                       help="take the model dir's writer lease from the trainer holding it (that trainer can no "
                            "longer commit); for a holder that is gone on another machine, or stuck")
    train.add_argument("--profile", action="store_true",
                       help="trace training steps with torch.profiler into MODEL_DIR/profile/, one trace per rank: "
                            "the config's profiler section, else its defaults (steps 13-15)")
    multi = train.add_argument_group(
        "multi-process training", "start the ranks through torch's launcher (python -m torch.distributed.run); "
        "under an external torchrun, leave these out: each rank picks up its place from the environment")
    multi.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="processes on this machine (typically one per GPU)")
    multi.add_argument("--nnodes", type=int, default=None, metavar="M",
                       help="machines in the job (default 1; more needs --rdzv-endpoint)")
    multi.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this machine's rank among the nodes (torchrun's --node-rank)")
    multi.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the c10d rendezvous every node joins (default: a standalone job on this machine)")
    multi.add_argument("--rdzv-id", default=None, metavar="ID",
                       help="the job's id at the rendezvous, the same on every node (default: torchrun's)")
    multi.add_argument("--max-restarts", type=int, default=None, metavar="K",
                       help="when a rank fails (killed, crashed, or ended by its hang watchdog: trainer.hang_timeout), "
                            "stop the others and restart the whole job from its latest checkpoint, up to K times "
                            "(torchrun's elastic agent; default 0: a failed rank ends the job)")

    evaluate = sub.add_parser("evaluate", help="evaluate a checkpoint; print its metrics as JSON")
    add_config_args(evaluate, model_dir_required=True)
    evaluate.add_argument("--checkpoint", type=int, default=None, metavar="STEP",
                          help="the checkpoint's step (default: the latest committed)")
    evaluate.add_argument("--continuous", action="store_true",
                          help="run as the sidecar evaluator: evaluate checkpoints as the trainer commits them")
    evaluate.add_argument("--mode", choices=["every", "latest"], default=None,
                          help="with --continuous: every checkpoint in order, or only the newest (sidecar.mode)")
    evaluate.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                          help="with --continuous: stop after this long without a new checkpoint (sidecar.timeout)")
    evaluate.add_argument("--max-evaluations", type=int, default=None, metavar="N",
                          help="with --continuous: stop after N evaluations (sidecar.max_evaluations)")
    evaluate.add_argument("--name", default=None, help="with --continuous: write to eval_<name>/ (sidecar.name)")
    evaluate.add_argument("--nproc", type=int, default=None, metavar="N",
                          help="evaluate the checkpoint on N processes of this machine (the data sharded, the "
                               "metrics reduced exactly); not with --continuous")

    launch = sub.add_parser("launch", help="train with a sidecar evaluator, as two processes on this machine")
    add_config_args(launch, model_dir_required=False)
    launch.add_argument("--sidecar", action="store_true",
                        help="start the trainer and a continuous evaluator; stream both with a prefix")
    launch.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping them (default 30)")
    launch.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="train on N processes of this machine (cadence train --nproc N); the sidecar is one more")
    launch.add_argument("--profile", action="store_true",
                        help="the trainer traces steps with torch.profiler, as cadence train --profile does")

    export = sub.add_parser("export", help="export a checkpoint as inference artefacts")
    export.add_argument("model_dir", help="model directory (its config.yaml builds the model)")
    export.add_argument("--checkpoint", default="best", metavar="best|latest|STEP",
                        help="which checkpoint (default: best)")
    export.add_argument("--format", dest="formats", action="append", required=True,
                        choices=list(EXPORT_FORMATS),
                        help="artefact format (repeatable)")
    export.add_argument("--out", default=None, metavar="DIR",
                        help="output directory (default: MODEL_DIR/export/best/<step> or export/checkpoint/<step>)")

    smoke = sub.add_parser("smoke", help="smoke-test a config: build, train a few steps, evaluate, checkpoint, "
                           "restore and export once, in a temporary model dir; one PASS/FAIL line per stage")
    smoke.add_argument("config", help="experiment config (YAML)")
    smoke.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set task.params.lr=0.1; name[N] is a list "
                            "item (repeatable)")
    smoke.add_argument("--steps", type=int, default=2, metavar="N", help="training steps (default 2)")
    smoke.add_argument("--keep", default=None, metavar="DIR",
                       help="use DIR (new or empty) as the model dir and keep it (default: a temp dir, removed)")

    ls = sub.add_parser("ls", help="list a model dir's committed checkpoints (or a sweep dir's trials)")
    ls.add_argument("model_dir", help="model directory (local path or fsspec URL)")
    ls.add_argument("--verify", action="store_true",
                    help="read every checkpoint's files against its manifest and mark those that do not match "
                         "(exit 1 if any)")
    ls.add_argument("--json", action="store_true",
                    help="print the listing as one JSON object (every checkpoint with its time, size, marks and "
                         "eval metrics; the best checkpoint) instead of a table")

    report = sub.add_parser("report", help="write a self-contained HTML run report (and a PNG of the plots); "
                            "of a sweep dir: its trials' curves and parameter importances")
    report.add_argument("model_dir", help="model directory (local path or fsspec URL)")
    report.add_argument("--out", default=None, metavar="PATH",
                        help="the HTML page to write (default: MODEL_DIR/report.html); the PNG goes next to it")

    sweep = sub.add_parser("sweep", help="search hyperparameters on Optuna: trials of the config in SWEEP_DIR/trial-<n>/, "
                           "bad ones pruned from their evaluations; run it again to resume")
    sweep.add_argument("config", help="experiment config (YAML)")
    sweep.add_argument("--space", required=True, metavar="SPACE.yaml",
                       help="the search space: params (config keys with float, int or categorical ranges), sampler, "
                            "seed, metric, direction, pruner")
    sweep.add_argument("--trials", type=int, required=True, metavar="N", help="trials in the study, in all")
    sweep.add_argument("--parallel", type=int, default=1, metavar="K", help="trials run at once, each a process (default 1)")
    sweep.add_argument("--sweep-dir", default=None, metavar="DIR",
                       help="the sweep's local directory: study.db, trial-<n>/, best (default: the config's model_dir)")
    sweep.add_argument("--sidecar", action="store_true",
                       help="run each trial with a sidecar evaluator (cadence launch --sidecar), which reports to the "
                            "pruner; also when the config has trainer.in_process_validation: false")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value of every trial (repeatable)")
    sweep.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                       help="seconds between SIGTERM and SIGKILL when stopping the trials (default 30)")
    return parser


def _load(args: argparse.Namespace):
    from cadence.config import load_config
    from cadence.config.loading import check_own_model_dir

    cfg = load_config(args.config, overrides=args.overrides, model_dir=args.model_dir)
    explicit = args.model_dir is not None or any(o.split("=", 1)[0].strip() == "model_dir" for o in args.overrides)
    if not explicit:  # a moved model dir's own config.yaml must not start a new run elsewhere
        check_own_model_dir(cfg, args.config)
    return cfg


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    if args.profile and _load(args).profiler is None:  # an override: the ranks of --nproc get it too
        args.overrides.append("profiler={}")
    if wants_torchrun(args):
        return train_with_torchrun(args, _claim_model_dir(args, _load(args), check=True), console)
    rank = env_rank()
    if rank != 0:  # one process reports: the other ranks log warnings and errors only
        root = logging.getLogger()
        root.setLevel(max(root.getEffectiveLevel(), logging.WARNING))
    else:
        log_restart()  # a torchrun job restarted after a failure (--max-restarts)
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
    shown = "  ".join(f"{k}={format_value(v)}" for k, v in (metrics or {}).items()) or "trained (no in-process evaluation)"
    console.print(f"[bold]done[/bold]: {shown}")
    console.print(f"model dir: {cfg.model_dir}  (cadence ls {cfg.model_dir}; tensorboard --logdir {cfg.model_dir})")
    return 0


def _claim_model_dir(args: argparse.Namespace, cfg: ExperimentConfig, *, check: bool) -> ExperimentConfig:
    """Before any rank starts: with ``--take-over`` fence off the holder of the model dir's writer
    lease; else, with ``check``, refuse now (exit 2) when another trainer holds it."""
    from cadence.checkpoint import writer_lease

    model_dir = layout.check_model_dir(cfg.require_model_dir())
    if args.take_over:
        if writer_lease.take_over(model_dir) is None:
            logger.info("--take-over: nobody holds the writer lease of %s", model_dir)
    elif check:
        writer_lease.check_free(model_dir)
    return cfg


def _cmd_evaluate(args: argparse.Namespace, console: Console) -> int:
    sidecar_flags = {"sidecar.mode": args.mode, "sidecar.timeout": args.timeout,
                     "sidecar.max_evaluations": args.max_evaluations, "sidecar.name": args.name}
    given = [flag for flag, value in sidecar_flags.items() if value is not None]
    if args.continuous and args.nproc is not None:
        raise ConfigError("--nproc and --continuous exclude each other (the sidecar is one process)")
    if args.continuous:
        args.overrides += [f"{flag}={json.dumps(sidecar_flags[flag])}" for flag in given]
        return _cmd_sidecar(args, console)
    if given:
        raise ConfigError(f"--mode, --timeout, --max-evaluations and --name need --continuous (got {', '.join(given)})")
    cfg = _load(args)
    if args.nproc is not None:
        return _evaluate_with_torchrun(args, cfg, console)
    if env_rank() != 0:  # under torchrun one process reports: the others log warnings and errors only
        root = logging.getLogger()
        root.setLevel(max(root.getEffectiveLevel(), logging.WARNING))
    from cadence.torch.experiments.experiment import run_evaluation

    try:
        step, metrics = run_evaluation(cfg, args.checkpoint)
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


_RESULT_ENV = "CADENCE_EVALUATE_RESULT"
"""Where the chief of ``cadence evaluate --nproc N`` writes its JSON line for the launcher to print."""


def _evaluate_with_torchrun(args: argparse.Namespace, cfg: Any, console: Console) -> int:
    """``cadence evaluate --nproc N``: the evaluation on N processes through torch's launcher;
    the chief's JSON line printed here."""
    import tempfile

    if args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--nproc: this process already runs under torchrun; leave --nproc out")
    for name in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts"):
        setattr(args, name, None)
    extra = ["--checkpoint", str(args.checkpoint)] if args.checkpoint is not None else []
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


def _cmd_sidecar(args: argparse.Namespace, console: Console) -> int:
    if args.checkpoint is not None:
        raise ConfigError("--checkpoint and --continuous exclude each other")
    cfg = _load(args)
    from cadence.torch.experiments.experiment import run_sidecar

    return _sidecar_done(run_sidecar(cfg), console)


def _sidecar_done(result: Any, console: Console) -> int:
    """Print a sidecar's :class:`~cadence.sidecar.evaluator.SidecarResult` as JSON; 1 when it timed out."""
    print(json.dumps(dataclasses.asdict(result), default=str))
    if result.stop_reason == "timeout":
        console.print(f"[red]cadence: sidecar stopped:[/red] {result.message}", highlight=False, soft_wrap=True)
        return 1
    return 0


def _cmd_launch(args: argparse.Namespace, console: Console) -> int:
    if not args.sidecar:
        raise ConfigError("launch: nothing to launch; add --sidecar")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    cfg = _load(args)  # a bad config fails here (exit 2), before anything starts
    if args.profile and cfg.profiler is None:  # both processes get it; only the trainer traces
        args.overrides.append("profiler={}")
    model_dir = cfg.require_model_dir()
    from cadence.checkpoint.leases import Leases
    from cadence.cluster.launch import launch, launch_exit_code, sidecar_commands
    from cadence.sidecar.evaluator import lease_holder

    leases = Leases(layout.checkpoints_dir(model_dir))
    holder = lease_holder(cfg.sidecar.name)

    def sidecar_ready() -> bool:  # its lease protects every checkpoint from the trainer's retention
        return any(lease.holder == holder for lease in leases.active())

    codes = launch(sidecar_commands(args.config, model_dir, args.overrides, nproc=args.nproc), env={"COLUMNS": "120"},
                   stop_others_on_failure=["trainer"], grace_s=args.grace,
                   start_when={"trainer": sidecar_ready})
    for name, code in codes.items():
        console.print(f"{name}: exit {code}")
    if codes.get("sidecar") == 0:
        console.print(f"evaluations: {layout.eval_dir(model_dir, cfg.sidecar.name)}/evaluations.jsonl; "
                      f"cadence ls {model_dir}")
    return launch_exit_code(codes)


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    if args.checkpoint not in ("best", "latest") and not args.checkpoint.isdigit():
        raise ConfigError(f"--checkpoint: expected best, latest or a step number, got {args.checkpoint!r}")
    from cadence.torch.experiments.experiment import run_export

    step, directory, files = run_export(args.model_dir, args.formats, args.checkpoint, args.out)
    console.print(f"exported step {step} to {directory}")
    for fmt, path in files.items():
        print(f"{fmt}\t{path}")
    return 0


def _cmd_ls(args: argparse.Namespace, console: Console) -> int:
    import shutil

    from cadence.sweep.study import is_sweep_dir

    if is_sweep_dir(args.model_dir):
        from cadence.sweep.command import ls_sweep

        return ls_sweep(args)
    from cadence.reports.listing import format_table, list_checkpoints

    listing = list_checkpoints(args.model_dir, verify=args.verify)
    if args.json:
        print(json.dumps(listing, indent=1))
    elif not listing["checkpoints"]:  # nothing to list: a note, on stderr
        console.print(format_table(listing), highlight=False, soft_wrap=True)
    else:
        print(format_table(listing, width=shutil.get_terminal_size().columns))
    return 1 if listing["corrupt"] else 0


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    from cadence.reports.run_report import build_report
    from cadence.sweep.study import is_sweep_dir

    if is_sweep_dir(args.model_dir):
        from cadence.sweep.command import report_sweep

        return report_sweep(args)
    paths = build_report(args.model_dir, args.out)
    print(paths.html)
    print(paths.png)
    return 0


_SMOKE_LABELS = {"ok": ("PASS", "green"), "failed": ("FAIL", "bold red"), "skipped": ("SKIP", "yellow")}


def _cmd_smoke(args: argparse.Namespace, console: Console) -> int:
    """One line per stage on stdout, then a summary; on failure the failing stage's traceback on
    stderr and exit 1 (2 when the failure is a config error)."""
    from rich.text import Text

    from cadence.config import load_config

    if args.steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
    cfg = load_config(args.config, overrides=args.overrides)
    from cadence.torch.experiments.smoke import run_smoke

    root = logging.getLogger()
    if root.level == logging.INFO:  # the stage lines are the report; --log-level DEBUG shows the run's logs
        root.setLevel(logging.WARNING)
    report = run_smoke(cfg, steps=args.steps, keep_dir=args.keep)
    out = Console(highlight=False)
    for stage in report.stages:
        label, style = _SMOKE_LABELS[stage.status]
        line = Text.assemble((label, style), f"  {stage.name}")
        if stage.seconds is not None:
            line.append(f"{'':<{10 - len(stage.name)}}  {stage.seconds:5.2f}s  ")
            line.append(stage.error or stage.detail, style="red" if stage.error else "")
        out.print(line, soft_wrap=True)  # never wrapped: one line per stage
    failed = report.failed
    counts = {s: sum(r.status == s for r in report.stages) for s in ("ok", "failed", "skipped")}
    if failed is None:
        out.print(Text(f"smoke test passed: {counts['ok']} stages in {report.seconds:.1f}s", style="bold green"))
    else:
        out.print(Text(f"smoke test FAILED at {failed.name}: {counts['ok']} passed, 1 failed, "
                       f"{counts['skipped']} skipped ({report.seconds:.1f}s)", style="bold red"), soft_wrap=True)
    if report.model_dir is not None:
        out.print(Text(f"model dir kept: {report.model_dir}"), soft_wrap=True)
    if failed is None:
        return 0
    if failed.traceback:
        console.print(Text(failed.traceback.rstrip()), soft_wrap=True, highlight=False)
    return failed.exception.exit_code if isinstance(failed.exception, CadenceError) else 1


def _cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    from cadence.sweep.command import run_sweep

    return run_sweep(args)


COMMANDS = {"train": _cmd_train, "evaluate": _cmd_evaluate, "launch": _cmd_launch, "export": _cmd_export,
            "ls": _cmd_ls, "report": _cmd_report, "smoke": _cmd_smoke, "sweep": _cmd_sweep}


_CHATTY_LIBRARIES = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3")
"""Loggers kept at WARNING unless ``--log-level debug``: their INFO lines are noise to a user."""


_INSTALLED = tuple({os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})


def _quiet_third_party(record: logging.LogRecord) -> bool:
    """Installed libraries' records below WARNING are dropped (onnxscript's INFO lines on every
    ONNX export, ...) unless ``--log-level debug``; cadence's and the user's own code's pass."""
    if record.levelno >= logging.WARNING or record.name == "cadence" or record.name.startswith("cadence."):
        return True
    return not os.path.realpath(record.pathname).startswith(_INSTALLED)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    err = Console(stderr=True)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(message)s", datefmt="[%X]",
        handlers=[RichHandler(console=err, show_path=False, rich_tracebacks=False)], force=True,
    )
    if logging.getLogger().level > logging.DEBUG:  # object-store clients' INFO lines ("Found credentials ...")
        for name in _CHATTY_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_third_party)
    try:
        return COMMANDS[args.command](args, err)
    except CadenceError as exc:  # one line, never wrapped; escaped: "[x]" in a message is text, not markup
        label = "error" if exc.exit_code == 2 else "failed"  # bad input (nothing started) or a failure
        err.print(f"[red]cadence: {label}:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("cadence: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
