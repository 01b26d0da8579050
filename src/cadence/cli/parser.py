"""The ``cadence`` command's argument parser: every subcommand and its flags (docs/cli.md is
generated from it: :mod:`cadence.cli.docgen`)."""

from __future__ import annotations

import argparse

from cadence import __version__
from cadence.cli.flags import LOG_LEVELS, log_level
from cadence.config.schema import EXPORT_FORMATS


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``cadence [--version] [--log-level L] COMMAND ...``; ``args.command`` names the subcommand."""
    parser = argparse.ArgumentParser(
        prog="cadence", description="Train, evaluate and checkpoint PyTorch models in loops."
    )
    parser.add_argument("--version", action="version", version=f"cadence {__version__}")
    parser.add_argument("--log-level", default="INFO", type=log_level, metavar="LOG_LEVEL",
                        help=f"logging level: {', '.join(LOG_LEVELS)}, in any case (default: INFO)")
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
    train.add_argument("--requeue", action="store_true",
                       help="in a Slurm job: after the checkpoint of a SIGUSR1 (#SBATCH --signal=USR1@SECONDS), "
                            "requeue the job (scontrol requeue) and exit 0; it resumes from that checkpoint "
                            "(trainer.slurm.requeue)")
    multi = train.add_argument_group(
        "multi-process training", "start the ranks through torch's launcher (python -m torch.distributed.run); "
        "under an external torchrun or srun (one task per rank), leave these out: each rank picks up its place "
        "from the environment")
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
    multi.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                       help="settings of the c10d rendezvous, as torchrun's --rdzv-conf, e.g. "
                            "keep_alive_interval=2,keep_alive_max_attempt=3: a lost node is noticed after "
                            "interval x attempts seconds (torch's default 5 x 3)")
    multi.add_argument("--max-restarts", type=int, default=None, metavar="K",
                       help="when a rank fails (killed, crashed, or ended by its hang watchdog: trainer.hang_timeout), "
                            "stop the others and restart the whole job from its latest checkpoint, up to K times "
                            "(torchrun's elastic agent; default 0: a failed rank ends the job)")

    evaluate = sub.add_parser("evaluate", help="evaluate a checkpoint; print its metrics as JSON (--continuous: the "
                              "sidecar; --all, --steps: a backfill of past checkpoints)")
    add_config_args(evaluate, model_dir_required=True)
    evaluate.add_argument("--checkpoint", default=None, metavar="best|latest|STEP",
                          help="which checkpoint: best (best/'s, the best checkpoint's step), latest (the newest "
                               "committed) or a step (default: latest)")
    evaluate.add_argument("--initial", action="store_true",
                          help="evaluate the initialized model (build_model, then Task.initialize; no checkpoint "
                               "read) at step 0: the untrained baseline")
    evaluate.add_argument("--continuous", action="store_true",
                          help="run as the sidecar evaluator: evaluate checkpoints as the trainer commits them")
    evaluate.add_argument("--all", action="store_true",
                          help="backfill: evaluate every committed checkpoint that has no record under --name yet "
                               "(eval_<name>/evaluations.jsonl, the sidecar's), oldest first, then stop; run again "
                               "after a kill, it does only what is left")
    evaluate.add_argument("--steps", default=None, metavar="STEP,...",
                          help="backfill these committed steps (e.g. 100,200,300) as --all does: those without a "
                               "record, oldest first")
    evaluate.add_argument("--mode", choices=["every", "latest"], default=None,
                          help="with --continuous: every checkpoint in order, or only the newest (sidecar.mode)")
    evaluate.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                          help="with --continuous: stop after this long without a new checkpoint (sidecar.timeout)")
    evaluate.add_argument("--max-evaluations", type=int, default=None, metavar="N",
                          help="with --continuous: stop after N evaluations (sidecar.max_evaluations)")
    evaluate.add_argument("--name", default=None,
                          help="with --continuous, --all or --steps: write to eval_<name>/ (sidecar.name)")
    evaluate.add_argument("--nproc", type=int, default=None, metavar="N",
                          help="evaluate on N processes of this machine (the data sharded, the metrics reduced "
                               "exactly); with --continuous: a sidecar of N ranks (its chief, rank 0, alone "
                               "watches, holds the lease and writes evaluations.jsonl); not with --all or --steps")
    _sidecar_ranks_flags(evaluate.add_argument_group(
        "a sidecar of several ranks", "with --continuous --nproc N, as cadence train's multi-process flags; under "
        "an external torchrun or srun (one task per rank), leave these and --nproc out"))

    launch = sub.add_parser("launch", help="train with a sidecar evaluator, or as fault-tolerant replica groups, "
                                           "on this machine")
    add_config_args(launch, model_dir_required=False)
    launch.add_argument("--sidecar", action="store_true",
                        help="start the trainer and a continuous evaluator; stream both with a prefix")
    launch.add_argument("--replicas", type=int, default=None, metavar="R",
                        help="train as R fault-tolerant replica groups (torchft), each of one process or of "
                             "--nproc N: starts the lighthouse and the groups, restarts a group that dies; group 0 "
                             "commits the checkpoints")
    launch.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="with --replicas: restarts of each group at most (default 3)")
    launch.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping them (default 30)")
    launch.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="train on N processes of this machine (cadence train --nproc N); with --replicas: "
                             "each group's")
    launch.add_argument("--sidecar-nproc", type=int, default=None, metavar="N",
                        help="run the sidecar on N processes of this machine (cadence evaluate --continuous --nproc "
                             "N; default: one process)")
    launch.add_argument("--profile", action="store_true",
                        help="the trainer traces steps with torch.profiler, as cadence train --profile does")
    launch.add_argument("--no-progress", action="store_true",
                        help="the trainer prints no progress lines, as cadence train --no-progress (the sidecar "
                             "prints none)")

    export = sub.add_parser("export", help="export a checkpoint as inference artefacts")
    export.add_argument("model_dir", help="model directory (its config.yaml builds the model)")
    export.add_argument("--checkpoint", default="best", metavar="best|latest|STEP",
                        help="which checkpoint (default: best)")
    export.add_argument("--format", dest="formats", action="append", required=True,
                        choices=list(EXPORT_FORMATS),
                        help="artefact format (repeatable)")
    export.add_argument("--out", default=None, metavar="DIR",
                        help="output directory (default: MODEL_DIR/export/best/<step> or export/checkpoint/<step>): "
                             "new, empty, or an earlier cadence export, which is replaced; anything else is refused "
                             "(exit 2) and left as it is")

    smoke = sub.add_parser("smoke", help="smoke-test a config: build, train a few steps, evaluate, checkpoint, "
                           "restore and export once, in a temporary model dir; one PASS/FAIL line per stage")
    smoke.add_argument("config", help="experiment config (YAML)")
    smoke.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set task.params.lr=0.1; name[N] is a list "
                            "item (repeatable)")
    smoke.add_argument("--steps", type=int, default=2, metavar="N", help="training steps (default 2)")
    smoke.add_argument("--keep", default=None, metavar="DIR",
                       help="use DIR (new or empty) as the model dir and keep it (default: a temp dir, removed)")

    ls = sub.add_parser("ls", help="list a model dir's committed checkpoints (or a sweep dir's trials); "
                        "exit 1 when one is marked CORRUPT")
    ls.add_argument("model_dir", help="model directory (local path or fsspec URL)")
    ls.add_argument("--verify", action="store_true",
                    help="also read every checkpoint's files against its manifest and mark those that do not "
                         "match CORRUPT (without it, only a manifest that cannot be read is: the files are not "
                         "read). Either way the exit status is 1 when a checkpoint is marked CORRUPT, else 0")
    ls.add_argument("--json", action="store_true",
                    help="print the listing as one JSON object (every checkpoint with its time, size, marks and "
                         "eval metrics; the best checkpoint) instead of a table")

    report = sub.add_parser("report", help="write a self-contained HTML run report (and a PNG of the plots); "
                            "of a sweep dir: its trials' curves and parameter importances")
    report.add_argument("model_dir", help="model directory (local path or fsspec URL)")
    report.add_argument("--out", default=None, metavar="PATH",
                        help="the HTML page to write (default: MODEL_DIR/report.html); the PNG goes next to it. "
                             "Either replaces only a report cadence wrote; anything else is refused (exit 2)")

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


def _sidecar_ranks_flags(group: argparse._ArgumentGroup) -> None:
    """``cadence evaluate --continuous --nproc N``'s launcher flags (as ``cadence train``'s)."""
    group.add_argument("--nnodes", type=int, default=None, metavar="M",
                       help="machines in the sidecar's job (default 1; more needs --rdzv-endpoint)")
    group.add_argument("--node-rank", type=int, default=None, metavar="R", help="this machine's rank among the nodes")
    group.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the c10d rendezvous every node joins (default: a standalone job on this machine)")
    group.add_argument("--rdzv-id", default=None, metavar="ID", help="the job's id at the rendezvous")
    group.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                       help="settings of the c10d rendezvous, as torchrun's --rdzv-conf")
    group.add_argument("--max-restarts", type=int, default=None, metavar="K",
                       help="when a rank fails (killed, crashed), stop the others and restart the sidecar, up to K "
                            "times; it resumes after the last step in evaluations.jsonl (default 0: a failed rank "
                            "ends the sidecar, in one line naming it)")
