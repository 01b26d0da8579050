"""The ``cadence`` command.

    cadence train CONFIG [--model-dir DIR] [--set key=value ...] [--nproc N [--max-restarts K] [--nnodes M ...]]
    cadence evaluate CONFIG --model-dir DIR [--checkpoint STEP] [--set key=value ...]
    cadence evaluate CONFIG --model-dir DIR --continuous [--mode every|latest] [--timeout S] ...
    cadence evaluate CONFIG --model-dir DIR --all | --steps STEP,... [--name NAME]   (a backfill)
    cadence export MODEL_DIR [--checkpoint best|latest|STEP] --format FORMAT [--out DIR]
    cadence launch CONFIG --sidecar [--model-dir DIR] [--set key=value ...]
    cadence smoke CONFIG [--set key=value ...] [--steps N] [--keep DIR]
    cadence ls MODEL_DIR
    cadence report MODEL_DIR [--out PATH]      (needs matplotlib: pip install 'cadence[report]')
    cadence sweep CONFIG --space SPACE.yaml --trials N [--parallel K] [--sweep-dir DIR] [--sidecar] [--set ...]
    cadence ls SWEEP_DIR / cadence report SWEEP_DIR   (a sweep's trials; needs optuna: pip install 'cadence[sweep]')

Exit status: 0 success; 2 bad input, nothing started: an argument, a config or an override is wrong,
or names something that does not exist (a path, a model dir, a checkpoint step, the Task's code at
its first use) -- one readable line naming it, no traceback; 1 something that started failed, or
stored data is bad (a corrupt checkpoint). docs/design.md's "Exit codes" has the whole table.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from rich.console import Console
from rich.markup import escape

from cadence.cli.flags import check_flags
from cadence.cli.logs import setup_logging
from cadence.cli.model_dir import cmd_export, cmd_ls, cmd_report
from cadence.cli.node_loss import record_lost_nodes
from cadence.cli.parser import build_parser
from cadence.cli.smoke import cmd_smoke
from cadence.cli.torchrun import end_rank_now, record_for_launcher
from cadence.cli.train import cmd_evaluate, cmd_launch, cmd_sweep, cmd_train
from cadence.errors import CadenceError
from cadence.runtime.lost_peer import wait_for_the_launcher
from cadence.runtime.parent_death import die_with_agent

COMMANDS: dict[str, Callable[..., int]] = {
    "train": cmd_train, "evaluate": cmd_evaluate, "launch": cmd_launch, "export": cmd_export,
    "ls": cmd_ls, "report": cmd_report, "smoke": cmd_smoke, "sweep": cmd_sweep}
"""Each subcommand's function: ``(args, stderr console) -> exit status``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cadence`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    A :class:`~cadence.errors.CadenceError` becomes one line on stderr and its ``exit_code`` (2:
    bad input, nothing started; 1: a failure); Ctrl-C: 130. Bad arguments exit 2 through argparse,
    a numeric flag out of its range through :func:`~cadence.cli.flags.check_flags`.
    """
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    setup_logging(args.log_level, err)
    die_with_agent()  # a worker of cadence's torchrun agent ends when that agent dies
    try:
        check_flags(args)  # a numeric flag out of its range: nothing starts
        return COMMANDS[args.command](args, err)
    except CadenceError as exc:  # one line, never wrapped; escaped: "[x]" in a message is text, not markup
        label = "error" if exc.exit_code == 2 else "failed"  # bad input (nothing started) or a failure
        # a rank of `cadence train --nproc N` leaves its bad input to the launcher, which prints it once
        if not (exc.exit_code == 2 and record_for_launcher(str(exc))):
            err.print(f"[red]cadence: {label}:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if exc.every_rank and os.environ.get("TORCHELASTIC_RUN_ID"):  # every rank of every node ends together
            end_rank_now(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("cadence: interrupted")
        return 130
    except Exception as exc:  # a rank of a torchrun job whose peer failed first lets the launcher see that one
        if not record_lost_nodes(exc):  # unless that peer ran on another node, which stopped answering
            wait_for_the_launcher(exc)
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
