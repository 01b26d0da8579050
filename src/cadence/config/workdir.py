"""The run's working directory, ``workdir``: where the relative paths of a config mean what they say.

``cadence train`` records the directory it ran in into ``MODEL_DIR/config.yaml``
(:func:`portable_workdir`: relative to that file when the model dir lies inside it, so moving the
project with its model dirs keeps it right; absolute otherwise). Loading that file resolves it
against the file's folder (:func:`resolve_workdir`). A command given such a config runs its Task
there (:func:`in_workdir`): ``task.params`` (a data directory), ``task.init_from_pretrained`` and
whatever the Task's own code opens by a relative path mean what they meant at training, whichever
directory the command starts in -- Hydra's ``hydra.runtime.cwd``, applied for the user.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.storage import is_plain_path

if TYPE_CHECKING:
    from cadence.config.schema import ExperimentConfig

logger = logging.getLogger("cadence")

__all__ = ["absolute_local", "in_workdir", "portable_workdir", "resolve_workdir"]


def portable_workdir(workdir: str, directory: str | Path) -> str:
    """``workdir`` as a config file in the local ``directory`` records it: relative to ``directory``
    when ``directory`` lies inside ``workdir`` (a model dir inside the project it was trained from),
    else absolute."""
    base, target = os.path.realpath(workdir), os.path.realpath(directory)
    return os.path.relpath(base, target) if os.path.commonpath([base, target]) == base else base


def resolve_workdir(workdir: str, config_dir: str | Path | None) -> str:
    """A recorded ``workdir`` made absolute: a relative one against ``config_dir`` (the folder of the
    file it was read from; None: the current directory)."""
    path = os.path.expanduser(workdir)
    return os.path.abspath(os.path.join(config_dir if config_dir is not None else os.getcwd(), path))


def absolute_local(location: str) -> str:
    """A relative plain path made absolute against the current directory; anything else (absolute,
    ``~/...``, a URL) as it is."""
    if _relative(location):
        return os.path.abspath(location)
    return location


def _relative(location: str) -> bool:
    return is_plain_path(location) and not os.path.isabs(os.path.expanduser(location))


@contextmanager
def in_workdir(cfg: ExperimentConfig) -> Iterator[ExperimentConfig]:
    """Run the body in ``cfg.workdir`` (the current directory back afterwards); yield the config to
    run: a relative ``model_dir`` (given relative to the current directory) rewritten relative to
    ``workdir`` (so a config written there keeps it relative), and ``workdir`` cleared (a nested call
    stays where it is). Without a ``workdir``, ``cfg`` itself and
    nothing changes. A ``workdir`` that does not exist here (a model dir read on another machine) is
    a warning: the current directory stays."""
    workdir = cfg.workdir
    if workdir is None:
        yield cfg
        return
    if not os.path.isdir(workdir):
        logger.warning("workdir %s (the directory the run was trained in) does not exist here: relative paths "
                       "of the config resolve against the current directory", workdir)
        yield cfg
        return
    model_dir = cfg.model_dir
    if model_dir and _relative(model_dir):
        model_dir = os.path.relpath(os.path.abspath(model_dir), workdir)
    run = cfg.model_copy(update={"model_dir": model_dir, "workdir": None})
    before = os.getcwd()
    os.chdir(workdir)
    try:
        yield run
    finally:
        os.chdir(before)
