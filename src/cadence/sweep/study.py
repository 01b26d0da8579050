"""The sweep dir and its study: ``SWEEP_DIR/sweep.json`` (what the sweep is: the study's name, the
resolved config and space it was started with), ``SWEEP_DIR/study.db`` (the Optuna study, sqlite),
the lock that keeps a second ``cadence sweep`` off a running one, and ``trial-<n>/`` per trial.

A sweep dir is local: sqlite needs a local file system (its locks do not work over NFS or an
object store).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.errors import ConfigError
from cadence.storage import local_path, unwritable_reason
from cadence.sweep.space import SweepSpace

__all__ = ["STUDY_FILE", "SWEEP_FILE", "SweepDir", "SweepLock", "SweepRecord", "is_sweep_dir", "load_sweep", "new_record",
           "open_study"]

SWEEP_FILE = "sweep.json"
STUDY_FILE = "study.db"
LOCK_FILE = ".sweep.lock"
BEST_LINK = "best"
TRIAL_PREFIX = "trial-"


def is_sweep_dir(path: str) -> bool:
    """Whether ``path`` is a local directory holding a sweep (its ``sweep.json``)."""
    local = local_path(path)
    return local is not None and (Path(local) / SWEEP_FILE).is_file()


@dataclass(frozen=True)
class SweepDir:
    """The paths of a sweep dir (absolute)."""

    root: Path

    @classmethod
    def at(cls, path: str) -> SweepDir:
        """ConfigError when ``path`` is a URL (a sweep dir is local), a file, a model dir, or one this
        process cannot create or write (a file on its path, permission, a read-only file system)."""
        local = local_path(path)
        if local is None:
            raise ConfigError(f"--sweep-dir: a sweep dir is local (its study is a sqlite file), got {path}")
        root = Path(local).expanduser().resolve()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"--sweep-dir: not a directory: {root}")
        why = unwritable_reason(str(root))  # a file on its path, a directory this process may not write
        if why is not None:
            raise ConfigError(f"--sweep-dir {path}: {why}")
        if (root / "checkpoints").is_dir():
            raise ConfigError(f"--sweep-dir: {root} is a model dir (it has checkpoints/); a sweep needs a directory "
                              "of its own, which holds one model dir per trial")
        return cls(root)

    @property
    def record(self) -> Path:
        return self.root / SWEEP_FILE

    @property
    def study_file(self) -> Path:
        return self.root / STUDY_FILE

    @property
    def storage_url(self) -> str:
        return f"sqlite:///{self.study_file}"

    @property
    def best_link(self) -> Path:
        return self.root / BEST_LINK

    def trial_dir(self, number: int) -> Path:
        return self.root / f"{TRIAL_PREFIX}{number}"


@dataclass(frozen=True)
class SweepRecord:
    """``sweep.json``: the study's name and what the sweep was started with."""

    study_name: str
    metric: str
    direction: str
    evaluation: str  # "in-process" or "sidecar"
    config: dict[str, Any]
    space: dict[str, Any]
    created: float

    def to_json(self) -> str:
        return json.dumps({"version": 1, **self.__dict__}, indent=1, sort_keys=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> SweepRecord:
        """ConfigError when it is not a sweep record."""
        try:
            doc = json.loads(path.read_text())
            return cls(**{k: doc[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}: not a readable cadence sweep record ({e})") from None


class SweepLock:
    """An exclusive ``flock`` on ``SWEEP_DIR/.sweep.lock`` while a sweep runs there (released by
    the kernel when the process dies, also by ``kill -9``)."""

    def __init__(self, sweep_dir: SweepDir) -> None:
        self.path = sweep_dir.root / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> SweepLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"another cadence sweep (pid {holder}) is running on {self.path.parent}; "
                              "wait for it, or stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first key path (dotted) where two plain values differ; None when equal."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in list(a) + [k for k in b if k not in a]:
            found = _first_difference(a.get(key, "<missing>"), b.get(key, "<missing>"), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path or "(all)")


def _check_same(record: SweepRecord, wanted: SweepRecord, sweep_dir: SweepDir) -> None:
    for what, old, new in (("config", record.config, wanted.config), ("space", record.space, wanted.space)):
        where = _first_difference(old, new)
        if where is not None:
            raise ConfigError(f"{sweep_dir.root} holds a sweep of another {what} (it differs at {where}); give the "
                              f"same config, --set and space to resume it, or another --sweep-dir")
    if record.evaluation != wanted.evaluation:
        raise ConfigError(f"{sweep_dir.root} holds a sweep whose trials evaluate {record.evaluation}, not "
                          f"{wanted.evaluation}; resume it as it was started (with or without --sidecar)")


def open_study(sweep_dir: SweepDir, wanted: SweepRecord, space: SweepSpace) -> tuple[SweepRecord, Any, Any]:
    """``(record, study, storage)``: the sweep's record and its Optuna study (and the study's
    storage), created on the first run, loaded on the next ones.

    ``wanted`` is what this run was given (its ``study_name`` and ``created`` are used only for a
    new sweep). The sampler's seed is the space's ``seed`` plus the trials the study holds already,
    so a resumed sweep does not sample the first trials' parameters again.

    Raises:
      ConfigError: the sweep dir holds a sweep of another config, space or evaluation mode.
    """
    from cadence.sweep._optuna import build_pruner, build_sampler, open_storage, require_optuna

    optuna = require_optuna()
    if sweep_dir.record.exists():
        record = SweepRecord.read(sweep_dir.record)
        _check_same(record, wanted, sweep_dir)
    else:
        record = wanted
        sweep_dir.root.mkdir(parents=True, exist_ok=True)
        temp = sweep_dir.record.with_name(f".{SWEEP_FILE}.tmp-{uuid.uuid4().hex[:8]}")
        temp.write_text(record.to_json())
        os.replace(temp, sweep_dir.record)
    storage = open_storage(sweep_dir.storage_url, create=True)
    existing = 0
    try:
        existing = len(storage.get_all_trials(storage.get_study_id_from_name(record.study_name), deepcopy=False))
    except KeyError:  # not created yet
        pass
    seed = None if space.seed is None else space.seed + existing
    study = optuna.create_study(storage=storage, study_name=record.study_name, direction=record.direction,
                                sampler=build_sampler(space.sampler, seed), pruner=build_pruner(space.pruner),
                                load_if_exists=True)
    return record, study, storage


def new_record(*, metric: str, direction: str, evaluation: str, config: dict[str, Any],
               space: SweepSpace) -> SweepRecord:
    """What a run of ``cadence sweep`` was given, with a fresh study name."""
    return SweepRecord(study_name=f"cadence-sweep-{uuid.uuid4().hex[:12]}", metric=metric, direction=direction,
                       evaluation=evaluation, config=config, space=space.model_dump(mode="json"), created=time.time())


def load_sweep(path: str) -> tuple[SweepDir, SweepRecord, Any]:
    """``(sweep_dir, record, study)`` of an existing sweep dir, for reading (``cadence ls``, ``report``).

    Raises:
      ConfigError: not a sweep dir; optuna missing; the study is not in ``study.db``.
    """
    from cadence.sweep._optuna import open_storage, require_optuna

    if not is_sweep_dir(path):
        raise ConfigError(f"not a sweep dir (no {SWEEP_FILE}): {path}")
    optuna = require_optuna(f"reading the sweep {path}")
    sweep_dir = SweepDir(Path(path).resolve())
    record = SweepRecord.read(sweep_dir.record)
    if not sweep_dir.study_file.is_file():
        raise ConfigError(f"{sweep_dir.root}: no {STUDY_FILE}: the sweep never started")
    try:
        study = optuna.load_study(study_name=record.study_name,
                                  storage=open_storage(sweep_dir.storage_url, create=False))
    except KeyError:
        raise ConfigError(f"{sweep_dir.study_file} holds no study {record.study_name!r}") from None
    return sweep_dir, record, study
