"""``SWEEP_DIR/best``: a symbolic link to what the best trial produced, replaced atomically (a new
link under a temporary name, then renamed over the old one) whenever the best trial changes.

It points, relative to the sweep dir (the dir can move), at the best trial's newest export of its
best model (``trial-<n>/export/best/<step>/``), else its final export, else its best checkpoint
(``trial-<n>/best/ckpt-<step>/``), else the trial's model dir.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from cadence import layout

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


def point_best(link: Path, trial_dir: Path) -> Path | None:
    """Make ``link`` point at :func:`best_target` of ``trial_dir`` (unchanged when it does already);
    the target, relative to the link's directory. A ``link`` that is a real file or directory is
    left alone (warned about) and None returned."""
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
