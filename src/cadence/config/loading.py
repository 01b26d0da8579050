"""Loading experiment configs: :func:`config_from_dict` (overrides, then validation),
:func:`load_config` (a YAML file) and :func:`save_config`. Every problem raises
:class:`~cadence.errors.ConfigError` with one line per problem, naming the source and the field::

    config.yaml: trainer.train_stpes: unknown field (did you mean 'train_steps'?) (line 7)
    --set trainer.steps=5: unknown field 'trainer.steps' (did you mean 'trainer.train_steps'?)
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cadence.config.class_paths import portable_class_path, resolve_class_path
from cadence.config.errors import moved_key_errors, validation_message
from cadence.config.overrides import apply_flags, apply_overrides
from cadence.config.schema import ExperimentConfig
from cadence.config.workdir import portable_workdir, resolve_workdir
from cadence.config.yaml_io import Loc, parse_yaml, read_text
from cadence.errors import ConfigError
from cadence.storage import Storage, local_path

__all__ = ["check_own_model_dir", "config_from_dict", "load_config", "save_config"]


def _describe_type(value: Any) -> str:
    return {
        list: "a list",
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
    }.get(type(value), type(value).__name__)


def config_from_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    model_dir: str | None = None,
    source: str = "config",
    config_dir: str | Path | None = None,
    flags: Mapping[str, tuple[str, Any]] | None = None,
    _lines: Mapping[Loc, int] | None = None,
) -> ExperimentConfig:
    """Validate plain data (as read from YAML) into an :class:`ExperimentConfig`.

    ``overrides`` are ``dotted.key=value`` strings applied first, then ``flags`` (command-line flags
    that set a value, ``{"--timeout": ("sidecar.timeout", 5.0)}``: an error names the flag), then
    ``model_dir`` (when not ``None``). ``source`` names the data in error messages; ``config_dir`` is
    recorded for :func:`resolve_task_class`, and a relative ``workdir`` resolved against it (one set by
    an override: against the current directory). Raises ConfigError.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {_describe_type(data)}"
        )
    work: dict[str, Any] = _deep_copy(data)
    overridden = apply_overrides(work, overrides)
    overridden.update(apply_flags(work, flags or {}))
    if model_dir is not None:
        work["model_dir"] = model_dir
        overridden[("model_dir",)] = f"--model-dir {model_dir}"
    moved = moved_key_errors(work, source, _lines or {}, overridden)
    if moved:
        raise ConfigError(moved)
    try:
        cfg = ExperimentConfig.model_validate(work)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, source, _lines or {}, overridden)) from None
    if cfg.workdir is not None:  # --set workdir=...: relative to here; the file's: to its folder
        cfg.workdir = resolve_workdir(cfg.workdir, None if ("workdir",) in overridden else config_dir)
    if config_dir is not None:
        cfg._config_dir = Path(config_dir).resolve()
        for spec in (cfg.task, *cfg.callbacks):  # importable from any working directory
            spec.class_path = resolve_class_path(spec.class_path, cfg.config_dir)
    return cfg


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(
    path: str | Path, overrides: Sequence[str] = (), model_dir: str | None = None,
    flags: Mapping[str, tuple[str, Any]] | None = None,
) -> ExperimentConfig:
    """Read, override and validate a YAML config file; raise ConfigError on any problem.

    ``overrides`` are ``dotted.key=value`` strings (value parsed as YAML), applied in order; a
    key outside the schema is an error, except below ``task.params``. ``flags``: values set by
    command-line flags, named by them in errors (see :func:`config_from_dict`). ``model_dir``,
    when given, replaces the file's ``model_dir``. The file's directory is recorded (``cfg.config_dir``) so
    that a relative ``file.py:Class`` can be resolved by :func:`resolve_task_class`.
    """
    source = os.fspath(path)
    text = read_text(source)
    data, lines = parse_yaml(text, source)
    if data is None:
        raise ConfigError(f"{source}: the file is empty (expected a mapping with at least 'task')")
    local = local_path(source)
    config_dir = Path(local).parent if local is not None else None
    return config_from_dict(
        data, overrides, model_dir=model_dir, source=source, config_dir=config_dir, flags=flags, _lines=lines
    )


def save_config(cfg: ExperimentConfig, path_or_url: str | Path, *, workdir: str | None = None) -> None:
    """Write the resolved config (:meth:`ExperimentConfig.to_dict`) as YAML to a local path or an
    fsspec URL, creating parents; atomic on local disks. In a local file, a ``file.py:Class`` whose
    file and the written file both lie inside the working directory is written relative to the
    written file (:func:`~cadence.config.class_paths.portable_class_path`); else absolute.
    ``workdir`` (default: the config's own) is recorded as the run's working directory, relative to a
    local file inside it (:func:`~cadence.config.workdir.portable_workdir`), else absolute."""
    from cadence.config.yaml_io import dump_yaml

    target = os.fspath(path_or_url)
    data = cfg.to_dict()
    if workdir is not None:
        data["workdir"] = os.path.abspath(workdir)
    local = local_path(target)
    if local is not None:
        directory = os.path.dirname(os.path.abspath(local))
        for entry in (data["task"], *data["callbacks"]):
            entry["class"] = portable_class_path(entry["class"], directory)
        if data["workdir"] is not None:
            data["workdir"] = portable_workdir(data["workdir"], directory)
    storage = Storage(target)
    storage.makedirs(posixpath.dirname(storage.root))
    storage.write_atomic(storage.root, dump_yaml(data).encode("utf-8"))


def check_own_model_dir(cfg: ExperimentConfig, config_path: str | Path) -> None:
    """ConfigError when ``config_path`` is the ``config.yaml`` of a local model dir (it has a
    ``checkpoints/`` beside it) whose ``model_dir`` names another directory: the model dir was
    moved (or the relative ``model_dir`` resolves against another working directory), and training
    from it would start a new run there. The message says to pass ``--model-dir``."""
    from cadence import layout

    source = os.fspath(config_path)
    local = local_path(source)
    if local is None:
        return
    path = Path(local)
    own = path.parent
    if path.name != layout.CONFIG or not (own / layout.CHECKPOINTS).is_dir() or not cfg.model_dir:
        return
    named_dir = local_path(cfg.model_dir)
    if named_dir is None:
        return
    named = Path(named_dir).expanduser()
    if os.path.realpath(named) != os.path.realpath(own):
        raise ConfigError(
            f"{source} is the config of the model dir {own}, but its model_dir is {cfg.model_dir} "
            f"({os.path.abspath(named)} from here): the model dir was moved, or model_dir is relative to "
            f"another working directory; pass --model-dir {own} to continue it (or --model-dir "
            f"{cfg.model_dir} to write there)"
        )
