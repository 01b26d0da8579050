"""``cadence smoke``: a config tried end to end in a temporary model dir, one PASS/FAIL line per stage."""

from __future__ import annotations

import argparse
import logging

from rich.console import Console

from cadence.errors import CadenceError

_SMOKE_LABELS = {"ok": ("PASS", "green"), "failed": ("FAIL", "bold red"), "skipped": ("SKIP", "yellow")}


def cmd_smoke(args: argparse.Namespace, console: Console) -> int:
    """One line per stage on stdout, then a summary; on failure the failing stage's traceback on
    stderr and exit 1 (2 when the failure is a config error)."""
    from rich.text import Text

    from cadence.config import load_config

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
