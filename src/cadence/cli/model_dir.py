"""The subcommands that read a model dir (or a sweep dir): ``cadence export``, ``ls`` and ``report``.

Each takes the parsed arguments and the stderr console, and returns the exit status.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console



def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from cadence.torch.experiments.experiment import run_export

    step, directory, files = run_export(args.model_dir, args.formats, args.checkpoint, args.out)
    console.print(f"exported step {step} to {directory}")
    for fmt, path in files.items():
        print(f"{fmt}\t{path}")
    return 0


def cmd_ls(args: argparse.Namespace, console: Console) -> int:
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


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from cadence.reports.run_report import build_report
    from cadence.sweep.study import is_sweep_dir

    if is_sweep_dir(args.model_dir):
        from cadence.sweep.command import report_sweep

        return report_sweep(args)
    paths = build_report(args.model_dir, args.out)
    print(paths.html)
    print(paths.png)
    return 0
