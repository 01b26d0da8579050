"""``cadence evaluate --continuous``: the sidecar in this process, alone or as one rank of a sidecar
of several (:func:`run_sidecar_here`: under ``--nproc N``'s torchrun, an external torchrun, or
``srun --ntasks N``), and ``--continuous --nproc N`` itself (:func:`sidecar_with_torchrun`).

A sidecar of N ranks prints one JSON line (its chief's :class:`~cadence.sidecar.evaluator.SidecarResult`)
and exits 1 when it timed out, as one process does. Under ``--nproc`` the chief hands the line to the
launcher, which prints it without torchrun's rank prefix, and every rank exits 0 on a timeout (a
rank's failure would make torchrun restart the job): the launcher's exit status says it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
from typing import Any

from rich.console import Console

from cadence.cli.torchrun import end_distributed, env_rank, restarts, train_with_torchrun
from cadence.cluster import slurm

logger = logging.getLogger("cadence")

__all__ = ["RESULT_ENV", "RESUMES", "run_sidecar_here", "sidecar_done", "sidecar_with_torchrun"]

RESULT_ENV = "CADENCE_SIDECAR_RESULT"
"""Where the chief of ``cadence evaluate --continuous --nproc N`` writes its JSON line for the launcher."""

RESUMES = "after the last step in evaluations.jsonl"
"""Where a restarted sidecar resumes, as the one-line error of a failed rank says it."""

_FLAGS = (("--mode", "mode"), ("--timeout", "timeout"), ("--max-evaluations", "max_evaluations"), ("--name", "name"))


def sidecar_with_torchrun(args: argparse.Namespace, cfg: Any, console: Console) -> int:
    """``cadence evaluate --continuous --nproc N``: the sidecar's ranks through torch's launcher
    (``--nnodes``, ``--max-restarts`` ... as ``cadence train``'s); the chief's JSON line printed here.
    A failed rank ends it in one line naming that rank (:func:`~cadence.cli.torchrun.failure_message`);
    with ``--max-restarts K`` the ranks start again and resume after the last recorded step."""
    extra = ["--continuous"]
    for flag, name in _FLAGS:
        if getattr(args, name) is not None:
            extra += [flag, str(getattr(args, name))]
    fd, result = tempfile.mkstemp(prefix="cadence-sidecar-", suffix=".json")
    os.close(fd)
    try:
        code = train_with_torchrun(args, cfg, console, command="evaluate", extra=extra,
                                   env_extra={RESULT_ENV: result}, resumes=RESUMES)
        with open(result) as f:
            line = f.read().strip()
    finally:
        os.unlink(result)
    if code != 0 or not line:  # no line, and no failure: the chief ran on another node, which prints it
        return code
    print(line)
    stopped = json.loads(line)
    if stopped.get("stop_reason") == "timeout":
        console.print(f"[red]cadence: sidecar stopped:[/red] {stopped.get('message')}", highlight=False,
                      soft_wrap=True)
        return 1
    return 0


def run_sidecar_here(cfg: Any, console: Console) -> int:
    """Run the sidecar in this process: alone, or as a rank (``RANK``/``WORLD_SIZE`` from torchrun,
    or a task of ``srun --ntasks N``). The chief reports (:func:`sidecar_done`); the other ranks log
    warnings and errors only and exit with the chief's status."""
    from cadence.torch.experiments.experiment import run_sidecar

    slurm.export_torchrun_env()  # a task of `srun --ntasks N`: a rank, as under torchrun
    rank = env_rank()
    if rank != 0:
        root = logging.getLogger()
        root.setLevel(max(root.getEffectiveLevel(), logging.WARNING))
    else:
        _log_restart()
    try:
        result = run_sidecar(cfg)
    except BaseException:
        end_distributed(ok=False)
        raise
    end_distributed(ok=True)  # under torchrun: a gloo group left to the interpreter's exit can abort it
    target = os.environ.pop(RESULT_ENV, None)
    if target:  # under --nproc: the launcher prints the line and exits 1 on a timeout
        if rank == 0:
            with open(target, "w") as f:
                f.write(_json(result))
        return 0
    if rank != 0:
        return 1 if result.stop_reason == "timeout" else 0
    return sidecar_done(result, console)


def sidecar_done(result: Any, console: Console) -> int:
    """Print a sidecar's :class:`~cadence.sidecar.evaluator.SidecarResult` as JSON; 1 when it timed out."""
    print(_json(result))
    if result.stop_reason == "timeout":
        console.print(f"[red]cadence: sidecar stopped:[/red] {result.message}", highlight=False, soft_wrap=True)
        return 1
    return 0


def _json(result: Any) -> str:
    return json.dumps(dataclasses.asdict(result), default=str)


def _log_restart() -> None:
    """In the chief of a sidecar that torchrun restarted: say so, and where it resumes."""
    count, limit = restarts()
    if count > 0:
        logger.warning("torchrun restarted the sidecar after a failure (restart %d of --max-restarts %d): it "
                       "resumes %s", count, limit, RESUMES)
