"""``SWEEP_DIR/best``: a symbolic link to what the best trial produced, replaced atomically (a new
link under a temporary name, then renamed over the old one) whenever the best trial changes.

It points, relative to the sweep dir (the dir can move), at the best trial's newest export of its
best model (``trial-<n>/export/best/<step>/``), else its final export, else its best checkpoint
(``trial-<n>/best/ckpt-<step>/``), else the trial's model dir.

Only a link cadence made is replaced: one whose target is relative and inside a ``trial-<n>/`` of
the sweep dir. A real file or directory, or a link pointing anywhere else, is the user's: left
alone, with a warning.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from cadence import layout
from cadence.sweep.study import TRIAL_PREFIX

logger = logging.getLogger("cadence.sweep")

__all__ = ["best_target", "point_best"]


def _newest_step_dir(directory: Path) -> Path | None:
    steps = [p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()] if directory.is_dir() else []
    return max(steps, key=lambda p: int(p.name)) if steps else None


def best_target(trial_dir: Path) -> Path:
    """What the best link shows of ``trial_dir`` (see the module docstring)."""
    for name in ("best", "final"):
        found = _newest_step_dir(trial_dir / layout.EXPORT / name)
        if found is not None:
            return found
    best = trial_dir / layout.BEST
    checkpoints = sorted((p for p in best.glob("ckpt-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:])) \
        if best.is_dir() else []
    return checkpoints[-1] if checkpoints else trial_dir


def _made_by_cadence(target: str) -> bool:
    """Whether a link's ``target`` is one :func:`point_best` writes: relative, inside a ``trial-<n>/``."""
    parts = Path(target).parts
    return (bool(parts) and not Path(target).is_absolute() and ".." not in parts
            and parts[0].startswith(TRIAL_PREFIX) and parts[0][len(TRIAL_PREFIX):].isdigit())


def point_best(link: Path, trial_dir: Path) -> Path | None:
    """Make ``link`` point at :func:`best_target` of ``trial_dir`` (unchanged when it does already);
    the target, relative to the link's directory. A ``link`` that is a real file or directory, or a
    symbolic link cadence did not make (see the module docstring), is left alone (warned about) and
    None returned."""
    if link.is_symlink() and not _made_by_cadence(os.readlink(link)):
        logger.warning("%s points at %s, not into a trial: not replacing it with the best trial's link", link,
                       os.readlink(link))
        return None
    if link.exists() and not link.is_symlink():
        logger.warning("%s is not a symbolic link: not replacing it with the best trial's", link)
        return None
    target = Path(os.path.relpath(best_target(trial_dir), link.parent))
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return target
    temp = link.with_name(f".{link.name}.tmp-{uuid.uuid4().hex[:8]}")
    os.symlink(target, temp)
    os.replace(temp, link)
    return target
