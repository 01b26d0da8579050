"""Exceptions shared across cadence."""

from __future__ import annotations


class CadenceError(Exception):
    """Base class of cadence's own errors.

    ``exit_code`` is the CLI's exit status when one ends a command (docs/design.md's "Exit codes"):
    2 when the input is wrong or names something that does not exist and nothing was started
    (:class:`ConfigError`, :class:`ModelDirError`, :class:`NoCheckpointError`, :class:`TaskOutputError`,
    :class:`TrainStepOutputError`, :class:`CheckpointMismatchError`, :class:`WriterLeaseHeldError`,
    :class:`ReaderLeaseHeldError`, :class:`SanityCheckError`, :class:`ModelDirNotSharedError`); 1 when something
    that started failed, or stored data is bad.
    """

    exit_code: int = 1
    every_rank: bool = False
    """Raised on every rank of a job at the same point, after the ranks agreed on it (a collective):
    under torchrun each rank then ends at once, without the interpreter's slow teardown, so that the
    ranks of every node end together (see :func:`cadence.cli.torchrun.end_rank_now`)."""


class StopTraining(Exception):
    """Raised by an action (or a trainer) to end training cleanly.

    The :class:`~cadence.Controller` catches it at the end of the current inner loop: the loop
    stops, the final checkpoint is saved (when a checkpoint manager is present), ``FINAL`` is
    written, and ``train`` / ``train_and_evaluate`` return normally. ``reason`` is logged.
    """

    def __init__(self, reason: str = "stop requested") -> None:
        super().__init__(reason)
        self.reason = reason


class PreemptedExit(SystemExit):
    """Raised after a checkpoint was committed because the job is being preempted (SIGTERM and
    the like; see :class:`~cadence.actions.SaveCheckpointIfPreempted`): the process exits with
    ``code``, and the :class:`~cadence.Controller` ends training normally on the way out (the
    callbacks' ``on_train_end`` runs)."""


class ConfigError(CadenceError):
    """A config file or override is invalid. The message names the offending field."""

    exit_code = 2


class ModelDirError(ConfigError):
    """A path given as a model dir cannot be one: missing where one must exist, a file (or a file on
    its path), not a cadence model dir (no ``config.yaml``, ``checkpoints/`` or ``train/``), or one
    this process may not create or write. Bad input (exit 2), one line naming the path."""


class TaskOutputError(CadenceError, TypeError):
    """A Task's builder (``build_model``) returned something of the wrong type: a mistake in the
    task's code, found at its first use, before anything was trained (exit 2); one line naming the
    method, what it returned and what is expected."""

    exit_code = 2


class ValidationOutputError(CadenceError, TypeError):
    """``validation_step`` (or another part of an evaluation the task writes) returned something
    of the wrong type; the message names it, what it returned and what is expected."""


class TrainStepOutputError(CadenceError, TypeError):
    """``Task.train_step`` returned something of the wrong type: no loss, a loss that is not a
    scalar tensor with a gradient, or an extra log that is not a scalar. A mistake in the task's
    code, found at its first step: bad input (exit 2), one line naming what it returned."""

    exit_code = 2


class SanityCheckError(CadenceError):
    """The sanity check before training (a few validation batches, then the eval actions'
    checks of their outputs; ``trainer.sanity_val_steps``) failed: nothing was trained."""

    exit_code = 2


class CheckpointError(CadenceError):
    """A checkpoint could not be written or read."""


class NoCheckpointError(CheckpointError):
    """There is no committed checkpoint where one was asked for (``cadence evaluate`` of a model dir
    that has none, ``--checkpoint STEP`` of a step not committed, ``export`` without ``best/``): bad
    input (exit 2), nothing was started."""

    exit_code = 2


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not fit the model the config builds (other names, or other shapes:
    a layer of another size): bad input (exit 2), the config does not fit the model dir; nothing
    was restored. The message names the file, the first tensor that differs with both shapes, and
    how many more do."""

    exit_code = 2


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint's files do not match its manifest (or the manifest is unreadable).

    Readers skip such a checkpoint; resume falls back to the previous one.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"corrupt checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointSpaceError(CheckpointError):
    """A checkpoint, ``FINAL`` or ``best/`` could not be written: its file system is full (or a
    quota or file-size limit was reached). Nothing partial is left visible; the previous
    checkpoint is intact. The message names the directory, the step and the free space."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would need arbitrary unpickling to load; it was refused, nothing ran."""


class TrainingDivergedError(CadenceError):
    """The loss stayed NaN/inf (or above its bound) after the allowed number of recoveries."""


class WriterLeaseHeldError(CadenceError):
    """Another live process holds the model dir's writer lease (see
    :mod:`cadence.checkpoint.writer_lease`); nothing was written. The message names the holder
    (host, pid, since) and how to take over."""

    exit_code = 2


class ReaderLeaseHeldError(CadenceError):
    """Another live process (a sidecar, or a backfill) evaluates under the same name in the model
    dir: it holds that name's reader lease (:meth:`cadence.checkpoint.leases.Leases.held_elsewhere`).
    Two would write one ``evaluations.jsonl``; nothing was written. The message names the holder
    (host, pid) and when its lease lapses."""

    exit_code = 2


class WriterLeaseLostError(CheckpointError):
    """This process no longer holds the model dir's writer lease (another took it over, or it
    could not renew it in time): the commit, deletion or FINAL it was about to make was not made."""


class ModelDirNotSharedError(CadenceError):
    """A rank of a multi-process job does not see the model dir the chief writes (node-local disks
    mounted at the same path on each machine; see :mod:`cadence.checkpoint.shared_dir`): found
    when the job starts, before any step; nothing was trained. Bad input (exit 2): the message
    names the ranks and their machines."""

    exit_code = 2
    every_rank = True


def one_line(error: BaseException, *, limit: int | None = None, all_lines: bool = False) -> str:
    """``error`` as one line for a message or a report: ``"TypeName: text"`` (``"TypeName"`` when its
    message is empty). ``text`` is the message's first non-empty line, or with ``all_lines`` every
    line joined by a space (a config error that lists several fields); runs of whitespace become
    one space. ``limit``: at most this many characters of ``text``, cut with ``...`` (None: whole)."""
    message = str(error)
    text = " ".join(message.split()) if all_lines else next(
        (" ".join(line.split()) for line in message.splitlines() if line.strip()), "")
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
