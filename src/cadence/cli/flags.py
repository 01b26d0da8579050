"""The bounds of the ``cadence`` command's numeric flags, in one place: :func:`check_flags` refuses a
value out of its range before the command starts (ConfigError, exit 2, naming the flag), and reads
``--checkpoint`` (:func:`checkpoint_selector`: ``best``, ``latest`` or a step, for every command that
takes one) and ``evaluate --steps`` (:func:`step_list`); :func:`log_level` is ``--log-level``'s type. A
flag that sets a config value (``evaluate --continuous --timeout``) is checked by the config's schema
instead, named by its flag (``load_config(flags=...)``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal

from cadence.config.base import MAX_SECONDS
from cadence.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""``--log-level``'s names (any case)."""


@dataclass(frozen=True)
class Bound:
    """A flag's range: an integer ``>= minimum``, or with ``seconds`` a finite number of seconds from
    ``minimum`` to :data:`~cadence.config.base.MAX_SECONDS`."""

    flag: str
    minimum: int
    seconds: bool = False

    def check(self, value: float) -> None:
        """ConfigError naming the flag when ``value`` is out of range."""
        if self.seconds:
            if not (math.isfinite(value) and self.minimum <= value <= MAX_SECONDS):
                raise ConfigError(f"{self.flag}: expected a number of seconds from {self.minimum} to {MAX_SECONDS}, "
                                  f"got {value}")
        elif value < self.minimum:
            raise ConfigError(f"{self.flag}: must be >= {self.minimum}, got {value}")


_NPROC = Bound("--nproc", 1)
_GRACE = Bound("--grace", 0, seconds=True)
BOUNDS: dict[str, dict[str, Bound]] = {
    "train": {"nproc": _NPROC, "nnodes": Bound("--nnodes", 1), "max_restarts": Bound("--max-restarts", 0)},
    "evaluate": {"nproc": _NPROC, "nnodes": Bound("--nnodes", 1), "max_restarts": Bound("--max-restarts", 0)},
    "launch": {"nproc": _NPROC, "sidecar_nproc": Bound("--sidecar-nproc", 1), "grace": _GRACE,
               "replicas": Bound("--replicas", 1), "max_restarts": Bound("--max-restarts", 0)},
    "smoke": {"steps": Bound("--steps", 1)},
    "sweep": {"trials": Bound("--trials", 1), "parallel": Bound("--parallel", 1), "grace": _GRACE},
}
"""Each command's numeric flags by their ``args`` name (``--node-rank``'s range depends on ``--nnodes``:
:func:`cadence.cli.torchrun.wants_torchrun` checks it)."""


CHECKPOINT_COMMANDS = ("evaluate", "export")
"""The commands whose ``--checkpoint`` names a checkpoint (:func:`checkpoint_selector`)."""

CheckpointSelector = Literal["best", "latest"] | int
"""Which checkpoint a command reads: ``best`` (``best/``'s), ``latest`` (the newest committed) or a step."""


def checkpoint_selector(text: str) -> CheckpointSelector:
    """``--checkpoint``'s value read: ``"best"``, ``"latest"`` or a step number (an int ``>= 0``);
    ConfigError (exit 2) naming the flag otherwise."""
    if text in ("best", "latest"):
        return "best" if text == "best" else "latest"
    if text.isascii() and text.isdigit():
        return int(text)
    raise ConfigError(f"--checkpoint: expected best, latest or a step number >= 0, got {text!r}")


def step_list(text: str) -> list[int]:
    """``evaluate --steps``' value read: step numbers (ints ``>= 0``) separated by commas, returned
    ascending without repeats; ConfigError (exit 2) naming the flag otherwise."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ConfigError(f"--steps: expected step numbers >= 0 separated by commas (e.g. 100,200,300), got {text!r}")
    return sorted({int(part) for part in parts})


def check_flags(args: argparse.Namespace) -> None:
    """ConfigError (exit 2) naming the first numeric flag of ``args.command`` given out of its range;
    a given ``--checkpoint`` is replaced by what it selects (:func:`checkpoint_selector`), and
    ``evaluate --steps`` by its steps (:func:`step_list`)."""
    for name, bound in BOUNDS.get(args.command, {}).items():
        value = getattr(args, name)
        if value is not None:
            bound.check(value)
    if args.command in CHECKPOINT_COMMANDS and isinstance(args.checkpoint, str):
        args.checkpoint = checkpoint_selector(args.checkpoint)
    if args.command == "evaluate" and isinstance(args.steps, str):
        args.steps = step_list(args.steps)


def log_level(text: str) -> str:
    """``--log-level``'s type: one of :data:`LOG_LEVELS`, in any case (returned as typed); argparse's
    error (exit 2) otherwise."""
    if text.strip().upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return text.strip()  # as typed: the ranks of --nproc get it so
