"""Hyperparameter sweeps on Optuna (``cadence sweep``): many trials of one config, each a normal
cadence run in ``SWEEP_DIR/trial-<n>/``, bad ones pruned from their evaluations, the whole sweep
resumable (its study is a sqlite file in the sweep dir). Framework-agnostic: no torch; optuna is
imported when a sweep runs (``pip install 'cadence[sweep]'``).

One job per module: :mod:`~cadence.sweep.space` (the space file), :mod:`~cadence.sweep.study`
(the sweep dir, its record and study), :mod:`~cadence.sweep.runner` (the trial processes),
:mod:`~cadence.sweep.pruning` (reporting and pruning inside a trial), :mod:`~cadence.sweep.trials`
(what a trial dir says), :mod:`~cadence.sweep.best_link` (``SWEEP_DIR/best``),
:mod:`~cadence.sweep.listing` / :mod:`~cadence.sweep.report` (``cadence ls`` / ``report``),
:mod:`~cadence.sweep.command` (what the CLI calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import lazy_attributes

_LAZY = {
    "ReportToTrial": "cadence.sweep.pruning",
    "StopWhenPruned": "cadence.sweep.pruning",
    "Sweep": "cadence.sweep.runner",
    "SweepOptions": "cadence.sweep.runner",
    "SweepSpace": "cadence.sweep.space",
    "is_sweep_dir": "cadence.sweep.study",
    "load_space": "cadence.sweep.space",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)

if TYPE_CHECKING:  # pragma: no cover
    from cadence.sweep.pruning import ReportToTrial, StopWhenPruned
    from cadence.sweep.runner import Sweep, SweepOptions
    from cadence.sweep.space import SweepSpace, load_space
    from cadence.sweep.study import is_sweep_dir
