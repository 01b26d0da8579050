"""The experiment config: a YAML file validated by pydantic, plus ``--set key=value`` overrides.

.. code-block:: yaml

    model_dir: runs/digits
    task:
      class: examples.digits.task:DigitsTask
      params: {hidden: [64, 32]}
    trainer:
      train_steps: 600
      steps_per_loop: 50

One job per module: :mod:`~cadence.config.schema` (the sections, their defaults and meaning),
:mod:`~cadence.config.yaml_io` (the YAML dialect, line numbers), :mod:`~cadence.config.overrides`
(``--set``), :mod:`~cadence.config.errors` (one-line messages derived from the schema),
:mod:`~cadence.config.class_paths` (``module:Class`` / ``file.py:Class``) and
:mod:`~cadence.config.loading` (:func:`load_config`, :func:`config_from_dict`, :func:`save_config`).
Every problem raises :class:`~cadence.errors.ConfigError` naming the source and the field.

The schema's names are imported here at once; loading and overrides (YAML, storage) on first use,
so that a component importing its section (``from cadence.config.schema import SidecarConfig``)
imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import lazy_attributes
from cadence.config import schema as _schema
from cadence.config.class_paths import resolve_class_path
from cadence.config.schema import *  # noqa: F403 - the sections and their names, re-exported

_LAZY = {
    "config_from_dict": "cadence.config.loading",
    "load_config": "cadence.config.loading",
    "save_config": "cadence.config.loading",
    "parse_override": "cadence.config.overrides",
}

__all__ = [*_schema.__all__, *_LAZY, "resolve_class_path"]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)

if TYPE_CHECKING:  # pragma: no cover
    from cadence.config.loading import config_from_dict, load_config, save_config
    from cadence.config.overrides import parse_override
