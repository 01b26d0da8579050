"""What a training run changed in its model dir before it trained anything, so that a run refused
by bad input leaves the model dir as it found it (docs/design.md, "A refused run").

A trainer must take the writer lease before it writes anything else (the lease is what stops a
second trainer), and it finds most bad input only after that: the checkpoint does not fit the
model, the sanity check fails, the first ``train_step`` returns no loss. So the chief notes, before
and right after taking the lease, what of the model dir's training layout exists
(:class:`ModelDirFootprint`): the model dir itself and ``.writer/`` (before: the lease creates
them), then ``checkpoints/``, ``best/``, ``train/`` and ``eval/``, and the bytes of the files a run
may write or remove before its first step (``config.yaml``, ``checkpoints/FINAL``,
``best/best.json``). A run refused (:func:`is_refusal`) before it trained a step or evaluated
anything takes back exactly that (:meth:`ModelDirFootprint.undo`), in reverse: each of those files
as it was (written back, or removed when there was none), each directory it created removed when
empty (a directory with anything it did not write in it stays), its own lease file withdrawn
(:meth:`~cadence.checkpoint.writer_lease.WriterLease.withdraw`), then ``.writer/`` and the model
dir when it created them and they are empty. What it finds and repairs at its start (a crashed
save's temp dirs, readers' leases expired for more than an hour, a corrupt checkpoint moved
aside) stays repaired.

:func:`check_training_paths` refuses, before anything is written, a model dir whose training
paths are of the wrong kind (``checkpoints`` a regular file, ``config.yaml`` a directory).
"""

from __future__ import annotations

import logging
from typing import Any

from cadence import layout
from cadence.checkpoint.final import FINAL_NAME
from cadence.checkpoint.writer_lease import WriterLease
from cadence.errors import CadenceError, ConfigError
from cadence.storage import Storage

__all__ = ["TRAINING_DIRS", "TRAINING_FILES", "ModelDirFootprint", "check_training_paths", "is_refusal"]

logger = logging.getLogger("cadence.checkpoint")

TRAINING_DIRS = (layout.CHECKPOINTS, layout.BEST, layout.TRAIN, layout.EVAL)
"""The directories (relative to the model dir) a training run may create before its first step,
besides ``.writer/``; removed in the reverse order when it created them and is refused."""

TRAINING_FILES = (layout.CONFIG, f"{layout.CHECKPOINTS}/{FINAL_NAME}", f"{layout.BEST}/best.json")
"""The files a training run may write or remove before its first step: the resolved config, the
``FINAL`` a run that trains past it clears, the best record a resumed run writes again."""


def is_refusal(error: BaseException | None) -> bool:
    """Whether ``error`` ends a run as bad input (a :class:`~cadence.errors.CadenceError` with exit
    status 2: a config, a task's output, a checkpoint that does not fit the model, ...)."""
    return isinstance(error, CadenceError) and error.exit_code == 2


def check_training_paths(model_dir: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """Raise :class:`~cadence.errors.ConfigError` (bad input, nothing written) when a path a
    training run writes in ``model_dir`` is of the wrong kind: ``.writer``, ``checkpoints``,
    ``best``, ``train`` or ``eval`` a file, or ``config.yaml`` a directory."""
    storage = Storage(model_dir, storage_options)
    if not storage.isdir(storage.root):
        return  # nothing in it yet (a file instead of the model dir is layout.check_model_dir's)
    for name in (layout.WRITER, *TRAINING_DIRS):
        if storage.isfile(storage.join(name)):
            raise ConfigError(f"{storage.url(storage.join(name))} is a file, not a directory: a training run "
                              f"writes its {name} there; move it away or pick another model dir")
    config = storage.join(layout.CONFIG)
    if storage.isdir(config):
        raise ConfigError(f"{storage.url(config)} is a directory, not a file: a training run writes its "
                          "resolved config there; move it away or pick another model dir")


class ModelDirFootprint:
    """The model dir's training layout as one run found it (see the module doc); the chief's.

    Make it before taking the writer lease, call :meth:`held` once the lease is taken, and
    :meth:`undo` when the run is refused before it trained or evaluated anything (then instead of
    releasing the lease)."""

    def __init__(self, model_dir: str, *, storage_options: dict[str, Any] | None = None,
                 parents: tuple[str, ...] = ()) -> None:
        self.storage = Storage(model_dir, storage_options)
        root = self.storage.root
        self._model_dir_existed = self.storage.isdir(root)
        # a replica group's own directory (``parents``: MODEL_DIR/replicas, MODEL_DIR): removed when created and empty
        self._parents = [(parent.root, parent.isdir(parent.root)) for parent in (Storage(p, storage_options) for p in parents)]
        self._writer_existed = self._model_dir_existed and self.storage.isdir(self.storage.join(layout.WRITER))
        self._dirs_existed: dict[str, bool] = {}
        self._files: dict[str, bytes | None] = {}
        self._undone = False

    def held(self) -> None:
        """Note the directories and files a run changes once it holds the writer lease (read now:
        no other trainer changes them while it is held)."""
        for name in TRAINING_DIRS:
            self._dirs_existed[name] = self.storage.isdir(self.storage.join(name))
        for name in TRAINING_FILES:
            self._files[name] = self._read(name)

    def undo(self, lease: WriterLease | None) -> list[str]:
        """Take back what the run changed (see the module doc) and withdraw ``lease`` (None: a replica
        group standing by, which holds none and wrote only into its own directory); return the paths
        removed or written back, as users see them. Best effort: what cannot be taken back is logged
        and left. Idempotent."""
        if self._undone:
            return []
        self._undone = True
        changed: list[str] = []
        for name in reversed(TRAINING_FILES):
            if name in self._files and self._put_back(name, self._files[name]):
                changed.append(self.storage.url(self.storage.join(name)))
        for name in reversed(TRAINING_DIRS):
            if self._dirs_existed.get(name) is False:
                changed += self._remove_dir(self.storage.join(name))
        if lease is not None:
            lease.withdraw()
        if not self._writer_existed:
            changed += self._remove_dir(self.storage.join(layout.WRITER))
        if not self._model_dir_existed:
            changed += self._remove_dir(self.storage.root)
            for parent, existed in self._parents:
                if not existed:
                    changed += self._remove_dir(parent)
        if changed:
            logger.debug("refused run: took back %s", ", ".join(changed))
        return changed

    def _read(self, name: str) -> bytes | None:
        try:
            return self.storage.read_bytes(self.storage.join(name))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _put_back(self, name: str, before: bytes | None) -> bool:
        """``name`` as it was before the run: True when it had to be written back or removed."""
        path = self.storage.join(name)
        try:
            if self._read(name) == before:
                return False
            if before is None:
                self.storage.remove(path)
            else:
                self.storage.write_atomic(path, before)
            return True
        except OSError as e:
            logger.warning("a refused run could not put %s back as it was: %s", self.storage.url(path), e)
            return False

    def _remove_dir(self, path: str) -> list[str]:
        try:
            return [self.storage.url(path)] if self.storage.remove_empty_dir(path) else []
        except OSError as e:
            logger.warning("a refused run could not remove the directory it created, %s: %s", self.storage.url(path), e)
            return []
