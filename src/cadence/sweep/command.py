"""The ``cadence sweep`` command, and ``cadence ls`` / ``cadence report`` on a sweep dir: what the
CLI calls, printing its lines and returning the exit status."""

from __future__ import annotations

import argparse
import json
import shutil

from cadence.summaries.progress import format_value

__all__ = ["ls_sweep", "report_sweep", "run_sweep"]


def run_sweep(args: argparse.Namespace) -> int:
    """Run or resume the sweep; 0 when the study holds ``--trials`` finished trials and one is
    complete (the best is printed), 1 when none completed, ``128 + N`` when signal N stopped it."""
    from cadence.sweep.runner import Sweep, SweepOptions

    sweep = Sweep(SweepOptions(config=args.config, space=args.space, trials=args.trials, parallel=args.parallel,
                               sweep_dir=args.sweep_dir, overrides=list(args.overrides), sidecar=args.sidecar,
                               grace_s=args.grace))
    result = sweep.run()
    counts = ", ".join(f"{n} {state}" for state, n in sorted(result.counts.items()))
    if result.stopped_by is not None:
        print(f"sweep stopped ({counts}); run the same command to resume it", flush=True)
        return 128 + result.stopped_by
    print(f"sweep done: {counts}", flush=True)
    if result.best is None:
        print("no trial completed: nothing is best (cadence ls for the reasons)", flush=True)
        return 1
    params = "  ".join(f"{k}={format_value(v)}" for k, v in result.best["params"].items())
    print(f"best: trial {result.best['number']}: {sweep.metric}={format_value(result.best['value'])}  {params}",
          flush=True)
    if result.best["link"]:
        print(f"{sweep.dir.best_link} -> {result.best['link']}", flush=True)
    print(f"cadence ls {sweep.dir.root}; cadence report {sweep.dir.root}", flush=True)
    return 0


def ls_sweep(args: argparse.Namespace) -> int:
    """``cadence ls SWEEP_DIR [--json]``."""
    from cadence.sweep.listing import format_sweep_table, sweep_listing

    listing = sweep_listing(args.model_dir)
    if args.json:
        print(json.dumps(listing, indent=1, default=str))
    else:
        print(format_sweep_table(listing, width=max(80, shutil.get_terminal_size().columns)))
    return 0


def report_sweep(args: argparse.Namespace) -> int:
    """``cadence report SWEEP_DIR [--out PATH]``."""
    from cadence.sweep.report import build_sweep_report

    paths = build_sweep_report(args.model_dir, args.out)
    print(paths.html)
    print(paths.png)
    return 0
