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
"""

from cadence.config import schema as _schema
from cadence.config.class_paths import resolve_class_path
from cadence.config.loading import config_from_dict, load_config, save_config
from cadence.config.overrides import parse_override
from cadence.config.schema import *  # noqa: F403 - the sections and their names, re-exported

__all__ = [*_schema.__all__, "config_from_dict", "load_config", "parse_override", "resolve_class_path", "save_config"]
