"""Optuna, imported on first use: the one-line error when it is missing, its log lines routed
through cadence's logging, and the objects built from cadence's settings (storage, sampler, pruner)."""

from __future__ import annotations

import importlib
from typing import Any

from cadence.config.schema import PrunerConfig
from cadence.errors import ConfigError

__all__ = ["INSTALL_HINT", "build_pruner", "build_sampler", "open_storage", "pruner_name", "require_optuna"]

INSTALL_HINT = "pip install 'cadence[sweep]'"

SQLITE_TIMEOUT_S = 60.0
"""Seconds a connection waits for another process's write to the study's sqlite file (the sweep
and its trials write to it at once) before it gives up."""


def require_optuna(where: str = "cadence sweep") -> Any:
    """The ``optuna`` module; ConfigError naming :data:`INSTALL_HINT` when it is not installed.

    Optuna's own log handler is replaced by propagation to the ``optuna`` logger's parents (the
    CLI's handler shows its warnings; its INFO lines stay quiet unless ``--log-level debug``)."""
    try:
        optuna = importlib.import_module("optuna")
    except ImportError as e:
        raise ConfigError(f"{where}: optuna is not installed ({e}): {INSTALL_HINT}") from None
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    return optuna


def open_storage(url: str, *, create: bool) -> Any:
    """Optuna's RDB storage at ``url``; ``create=False`` (a trial process) skips creating the tables
    (the sweep created them), so processes opening the study at once never race on its schema."""
    optuna = require_optuna()
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}},
                                      skip_table_creation=not create)


def build_sampler(kind: str, seed: int | None) -> Any:
    """``tpe`` (Optuna's TPESampler) or ``random``, seeded with ``seed`` (None: not seeded)."""
    samplers = require_optuna().samplers
    if kind == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def build_pruner(config: PrunerConfig) -> Any:
    """Optuna's pruner from its settings (``kind: none`` is Optuna's NopPruner)."""
    pruners = require_optuna().pruners
    c = config
    if c.kind == "median":
        return pruners.MedianPruner(n_startup_trials=c.n_startup_trials, n_warmup_steps=c.n_warmup_steps,
                                    interval_steps=c.interval_steps, n_min_trials=c.n_min_trials)
    if c.kind == "successive_halving":
        return pruners.SuccessiveHalvingPruner(
            min_resource=c.min_resource if c.min_resource is not None else "auto",
            reduction_factor=c.reduction_factor if c.reduction_factor is not None else 4,
            min_early_stopping_rate=c.min_early_stopping_rate, bootstrap_count=c.bootstrap_count)
    if c.kind == "hyperband":
        return pruners.HyperbandPruner(
            min_resource=c.min_resource if c.min_resource is not None else 1,
            max_resource=c.max_resource if c.max_resource is not None else "auto",
            reduction_factor=c.reduction_factor if c.reduction_factor is not None else 3,
            bootstrap_count=c.bootstrap_count)
    return pruners.NopPruner()


def pruner_name(pruner: Any) -> str:
    """How messages name a pruner: its class (``MedianPruner``)."""
    return type(pruner).__name__
