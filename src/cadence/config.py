"""The experiment config: a YAML file validated by pydantic, plus ``--set key=value`` overrides.

.. code-block:: yaml

    model_dir: runs/digits
    task:
      class: examples.digits.task:DigitsTask
      params: {hidden: [64, 32]}
    trainer:
      train_steps: 600
      steps_per_loop: 50

Every problem -- a missing file, bad YAML, an unknown or mistyped field, a bad override -- raises
:class:`~cadence.errors.ConfigError` with one readable message that names the source and the
field path, one problem per line::

    config.yaml: trainer.train_stpes: unknown field (did you mean 'train_steps'?) (line 7)
    --set trainer.steps=5: unknown field 'trainer.steps' (did you mean 'trainer.train_steps'?)
"""

from __future__ import annotations

import datetime
import difflib
import os
import posixpath
import re
from pathlib import Path
from typing import Any, Literal
from collections.abc import Mapping, Sequence

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from cadence.errors import ConfigError

__all__ = [
    "BestCheckpointConfig",
    "CallbackConfig",
    "EarlyStoppingConfig",
    "ExperimentConfig",
    "ExportConfig",
    "RecoveryConfig",
    "SidecarConfig",
    "TaskConfig",
    "TrainerConfig",
    "config_from_dict",
    "load_config",
    "parse_override",
    "resolve_class_path",
    "resolve_task_class",
    "save_config",
]

Precision = Literal["32", "bf16", "fp16"]

_TASK_CLASS_RE = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*|.+\.py)"  # dotted module, or a path to a .py file
    r":(?P<cls>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)$"  # class name (Outer.Inner allowed)
)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_YAML_LINE_BREAKS = "\x85\u2028\u2029"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


def _none_to_empty(data: Any, keys: Sequence[str]) -> Any:
    """``trainer:`` with every entry commented out is YAML ``null``: read it as ``{}``."""
    if isinstance(data, dict):
        data = {k: ({} if k in keys and v is None else v) for k, v in data.items()}
    return data


class TaskConfig(_Model):
    """Which Task class to build, and its keyword arguments."""

    task_class: str = Field(
        alias="class",
        description=(
            "The Task class, as `module:ClassName` (imported from `sys.path`) or "
            "`path/to/file.py:ClassName` (a relative path is resolved against the config "
            "file's directory)."
        ),
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the Task class. Free-form: not validated here.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_params(cls, data: Any) -> Any:
        return _none_to_empty(data, ("params",))

    @field_validator("task_class")
    @classmethod
    def _check_task_class(cls, value: str) -> str:
        value = value.strip()
        if not _TASK_CLASS_RE.match(value):
            raise ValueError("expected 'module:ClassName' or 'path/to/file.py:ClassName'")
        return value


class CallbackConfig(_Model):
    """One callback (a `cadence.Callback`) told about the run's events: its class and keyword arguments."""

    callback_class: str = Field(
        alias="class",
        description=(
            "The callback class, as `module:ClassName` (imported from `sys.path`) or "
            "`path/to/file.py:ClassName` (a relative path is resolved against the config "
            "file's directory)."
        ),
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the callback class. Free-form: not validated here.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_params(cls, data: Any) -> Any:
        return _none_to_empty(data, ("params",))

    @field_validator("callback_class")
    @classmethod
    def _check_callback_class(cls, value: str) -> str:
        value = value.strip()
        if not _TASK_CLASS_RE.match(value):
            raise ValueError("expected 'module:ClassName' or 'path/to/file.py:ClassName'")
        return value


class BestCheckpointConfig(_Model):
    """Keep the best checkpoint so far in `MODEL_DIR/best/` (with `best.json`)."""

    metric: str = Field(description="The eval metric to compare (a key, or `a/b` for a nested one).")
    higher_is_better: bool = Field(default=True, description="`true`: larger is better (accuracy); `false`: smaller (loss).")


class EarlyStoppingConfig(_Model):
    """Stop training when an eval metric stops improving."""

    metric: str = Field(description="The eval metric to watch.")
    patience: int = Field(ge=1, strict=True, description="Evaluations without improvement before stopping.")
    min_delta: float = Field(default=0.0, ge=0, description="An improvement must exceed this much.")
    higher_is_better: bool = Field(default=True, description="`true`: larger is better; `false`: smaller.")


class RecoveryConfig(_Model):
    """Roll back to the latest checkpoint when the training loss diverges (NaN/inf, or above a bound)."""

    loss_upper_bound: float | None = Field(
        default=None, description="A loss above this counts as diverged too; `null`: only NaN/inf."
    )
    recovery_begin_steps: int = Field(
        default=0, ge=0, strict=True, description="The upper bound applies from this global step on."
    )
    max_trials: int = Field(
        default=3, ge=0, strict=True, description="Recoveries allowed over the run; the next divergence fails the run."
    )


ExportFormat = Literal["safetensors", "torch_export", "torchscript", "onnx"]


class ExportConfig(_Model):
    """Inference artefacts written under `MODEL_DIR/export/<on>/<step>/`."""

    formats: list[ExportFormat] = Field(
        default_factory=lambda: list[ExportFormat](["safetensors"]),
        description="Artefacts per export: `safetensors`, `torch_export` (.pt2), `torchscript`, `onnx` (needs `cadence[onnx]`).",
    )
    on: Literal["best", "final", "every_eval"] = Field(
        default="best",
        description=("When to export: on a new best checkpoint (needs `trainer.best_checkpoint`), at the end of "
                     "training, or after every evaluation."),
    )
    max_to_keep: int | None = Field(
        default=5, ge=0, strict=True, description="Newest exports kept; `null` keeps all."
    )


class SidecarConfig(_Model):
    """The sidecar evaluator (`cadence evaluate --continuous`, `cadence launch --sidecar`)."""

    mode: Literal["every", "latest"] = Field(
        default="every", description="`every`: each committed checkpoint in step order; `latest`: jump to the newest."
    )
    timeout: float | None = Field(
        default=3600.0, ge=0,
        description="Stop after this many seconds without a new checkpoint (a dead trainer); `null`: wait for `FINAL`.",
    )
    poll_interval: float = Field(default=0.5, gt=0, description="Seconds between looks for new checkpoints.")
    max_pending: int | None = Field(
        default=8, ge=1, strict=True,
        description="Unevaluated checkpoints protected from the trainer's retention; the oldest beyond it are skipped.",
    )
    max_evaluations: int | None = Field(
        default=None, ge=1, strict=True, description="Stop after this many evaluations in total; `null`: no limit."
    )
    lease_ttl: float = Field(
        default=60.0, gt=0, description="Seconds a lease lives without renewal (a killed sidecar's lease ends then)."
    )
    name: str | None = Field(
        default=None, description="Write to `eval_<name>/` instead of `eval/` (several sidecars on one model dir)."
    )
    max_retries: int = Field(
        default=3, ge=0, strict=True,
        description="A committed checkpoint that fails to load is retried this many times, then recorded as failed.",
    )
    retry_backoff: float = Field(
        default=0.5, gt=0, description="Seconds before the first retry; each further retry waits twice as long.",
    )


class TrainerConfig(_Model):
    """How long to train, and when to checkpoint, validate and write summaries."""

    train_steps: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description=(
            "Total optimizer steps to train for; `null` "
            "trains until the training data is exhausted."
        ),
    )
    steps_per_loop: int = Field(
        default=100,
        ge=1,
        strict=True,
        description=(
            "Steps per inner loop. Checkpoints, validation, summaries and actions happen at loop "
            "boundaries, so every interval below is effectively rounded up to a multiple of it."
        ),
    )
    checkpoint_interval: int | None = Field(
        default=1000,
        ge=1,
        strict=True,
        description=(
            "Save a checkpoint every this many steps; `null` saves only when training completes."
        ),
    )
    validation_interval: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description=(
            "Validate every this many steps; `null` validates once, at the end of training."
        ),
    )
    validation_steps: int = Field(
        default=-1,
        strict=True,
        description="Batches per validation; `-1` uses the whole validation data.",
    )
    max_to_keep: int | None = Field(
        default=5,
        ge=0,
        strict=True,
        description=(
            "Keep the newest this many checkpoints (`0`: none "
            "besides the kept ones below); `null` keeps all."
        ),
    )
    keep_every_n_steps: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description=(
            "Also keep, forever, the checkpoints whose step "
            "is a multiple of this; `null`: no such rule."
        ),
    )
    summary_interval: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description=(
            "Write training summaries every this many steps (a "
            "multiple of `steps_per_loop`); `null`: every loop."
        ),
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=2**32 - 1,
        strict=True,
        description="Seed for the Python, NumPy and torch random number generators.",
    )
    precision: Precision = Field(
        default="32",
        description=(
            'Numeric precision: `"32"` (full), `"bf16"` '
            'or `"fp16"` (mixed precision with autocast).'
        ),
    )
    grad_accum_steps: int = Field(
        default=1,
        ge=1,
        strict=True,
        description="Micro-batches whose gradients are accumulated into each optimizer step.",
    )
    grad_clip_norm: float | None = Field(
        default=None,
        gt=0,
        strict=True,
        allow_inf_nan=False,
        description="Clip the global gradient norm to this value; `null`: no clipping.",
    )
    device: str = Field(
        default="auto",
        description="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.",
    )
    best_checkpoint: BestCheckpointConfig | None = Field(
        default=None, description="Keep the best checkpoint in `best/`; `null`: off."
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        default=None, description="Stop when an eval metric plateaus; `null`: off."
    )
    recovery: RecoveryConfig | None = Field(
        default=None, description="Roll back on a diverged loss; `null`: off (a NaN loss is only logged)."
    )
    async_checkpoint: bool = Field(
        default=False,
        description=(
            "Copy the state to CPU memory at a save and commit it from a background thread (one save in "
            "flight); the copy is reused by the next save, so one extra CPU copy of the state stays resident."
        ),
    )
    in_process_validation: bool = Field(
        default=True,
        description="Evaluate inside `cadence train`; `false`: only train (a sidecar evaluates the checkpoints).",
    )
    throttle_secs: float = Field(
        default=0.0, ge=0,
        description=("tf.estimator's `throttle_secs`: skip an in-process evaluation due sooner than this after the "
                     "previous one (never the final)."),
    )
    start_delay_secs: float = Field(
        default=0.0, ge=0,
        description=("tf.estimator's `start_delay_secs`: skip in-process evaluations due in the first this many "
                     "seconds (never the final)."),
    )
    save_on_preemption: bool = Field(
        default=True,
        description="On SIGTERM, SIGUSR1 or SIGINT, commit a checkpoint at the end of the current loop and exit 0.",
    )

    @field_validator("validation_steps")
    @classmethod
    def _check_validation_steps(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError("expected -1 (the whole validation data) or an integer >= 1")
        return value

    @field_validator("precision", mode="before")
    @classmethod
    def _normalise_precision(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value == 32:
            return "32"
        if isinstance(value, str):
            return value.strip().lower()
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        value = value.strip()
        if not _DEVICE_RE.match(value):
            raise ValueError("expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value

    @field_validator("summary_interval")
    @classmethod
    def _check_summary_interval(cls, value: int | None, info: Any) -> int | None:
        steps_per_loop = info.data.get("steps_per_loop")
        if value is not None and steps_per_loop and value % steps_per_loop:
            raise ValueError(f"must be a multiple of trainer.steps_per_loop ({steps_per_loop})")
        return value


class ExperimentConfig(_Model):
    """A whole experiment: where it writes, what it trains, and how."""

    model_dir: str | None = Field(
        default=None,
        description=(
            "The model directory (checkpoints, summaries, exports): a local path or an fsspec "
            "URL. The CLI's `--model-dir` overrides it."
        ),
    )
    task: TaskConfig = Field(description="The Task: what model, data and loss to train.")
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="The training loop's schedule and numerics."
    )
    sidecar: SidecarConfig = Field(
        default_factory=SidecarConfig, description="The sidecar evaluator's settings."
    )
    export: ExportConfig | None = Field(
        default=None, description="Export inference artefacts; `null`: no exports during training."
    )
    callbacks: list[CallbackConfig] = Field(
        default_factory=list,
        description=(
            "Callbacks (`cadence.Callback`) called at the run's events: training start and end, "
            "checkpoint saved or loaded, evaluation done, close. Built after the Task's own "
            "(`Task.build_callbacks()`), which come first."
        ),
    )

    _config_dir: Path | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        data = _none_to_empty(data, ("task", "trainer", "sidecar"))
        if isinstance(data, dict) and "callbacks" in data and data["callbacks"] is None:
            data = {**data, "callbacks": []}  # `callbacks:` with every entry commented out
        return data

    @model_validator(mode="after")
    def _export_on_best_needs_best_checkpoint(self) -> ExperimentConfig:
        if self.export is not None and self.export.on == "best" and self.trainer.best_checkpoint is None:
            raise ValueError(
                "export.on is 'best' but trainer.best_checkpoint is not set (set it, or export.on: final)"
            )
        return self

    def require_model_dir(self) -> str:
        """``model_dir``; ConfigError when it is not set (neither in the file nor ``--model-dir``)."""
        from cadence.layout import require_model_dir

        return require_model_dir(self.model_dir)

    @property
    def config_dir(self) -> Path | None:
        """Directory of the file this config was loaded from (``None`` if built in code)."""
        return self._config_dir

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data: by alias (``task.class``), task class absolute.

        Raises ConfigError when ``task.params`` holds something YAML cannot represent.
        """
        data = self.model_dump(by_alias=True)
        data["task"]["class"] = resolve_task_class(self)
        data["task"]["params"] = _plain(data["task"]["params"], "task.params")
        for i, entry in enumerate(data["callbacks"]):
            entry["class"] = resolve_class_path(entry["class"], self.config_dir)
            entry["params"] = _plain(entry["params"], f"callbacks[{i}].params")
        return data

    def to_yaml(self) -> str:
        """The resolved config as YAML (see :meth:`to_dict`); :func:`load_config` reads it back."""
        data = self.to_dict()
        text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
        if any(
            c in text for c in _YAML_LINE_BREAKS
        ):  # PyYAML writes them raw, then reads them as breaks
            text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=False)
        return text

    def __eq__(self, other: object) -> bool:
        """Equal when they describe the same experiment, wherever they were loaded from."""
        if not isinstance(other, ExperimentConfig):
            return NotImplemented
        return self._identity() == other._identity()

    def _identity(self) -> dict[str, Any]:
        data = self.model_dump(by_alias=True)
        data["task"]["class"] = resolve_task_class(self)
        for entry in data["callbacks"]:
            entry["class"] = resolve_class_path(entry["class"], self.config_dir)
        return data


def _plain(value: Any, path: str) -> Any:
    """``value`` as plain YAML data (tuples become lists); ConfigError on anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, datetime.date)):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{path}: {type(value).__name__} values cannot be written to a YAML config")


# --------------------------------------------------------------------------------------------
# task class paths


def _split_task_class(task_class: str) -> tuple[str, str]:
    module, _, cls = task_class.rpartition(":")
    return module, cls


def resolve_task_class(cfg: ExperimentConfig, config_dir: str | Path | None = None) -> str:
    """``task.class`` with a relative ``file.py`` made absolute; ``module:Class`` is unchanged.

    The path is resolved against ``config_dir``, else the directory recorded by
    :func:`load_config`, else the current directory.
    """
    return resolve_class_path(cfg.task.task_class, config_dir if config_dir is not None else cfg.config_dir)


def resolve_class_path(spec: str, config_dir: str | Path | None = None) -> str:
    """A class spec (``task.class``, ``callbacks[i].class``) with a relative ``file.py`` made
    absolute against ``config_dir`` (None: the current directory); ``module:Class`` is unchanged."""
    module, cls = _split_task_class(spec)
    if not module.endswith(".py") or "://" in module:
        return spec
    path = Path(module).expanduser()
    if not path.is_absolute():
        base = Path(config_dir) if config_dir is not None else Path.cwd()
        path = base / path
    return f"{os.path.abspath(path)}:{cls}"


# --------------------------------------------------------------------------------------------
# YAML reading with line numbers and duplicate-key detection

Loc = tuple[str, ...]


class _Loader(yaml.SafeLoader):
    """Safe YAML loader (no custom tags) with YAML 1.2's scalars: ``1e-3`` is a float, and only
    ``true``/``false`` are booleans (``on``, ``off``, ``yes``, ``no`` are strings)."""


class _Dumper(yaml.SafeDumper):
    """Safe YAML dumper: quotes strings like ``"1e-3"``, which :class:`_Loader` reads as floats."""


# YAML 1.2 booleans: only true/false. YAML 1.1 also reads on/off/yes/no/y/n as booleans, which
# turns the key `on:` (export.on) into True and `country: no` into False.
_Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """The document and the line of each mapping key (by key path). Raises ConfigError."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        if node is not None:
            _index_keys(node, (), lines, source)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise ConfigError(_format_yaml_error(exc, source)) from None
    finally:
        loader.dispose()
    return data, lines


def _index_keys(
    node: yaml.Node, loc: Loc, lines: dict[Loc, int], source: str, seen: set[int] | None = None
) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:  # aliases can make the graph cyclic
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if (
                not isinstance(key_node, yaml.ScalarNode)
                or key_node.tag == "tag:yaml.org,2002:merge"
            ):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in first_line:
                path = ".".join((*loc, key))
                raise ConfigError(
                    f"{source}: line {line}: duplicate key {path!r} "
                    f"(first set on line {first_line[key]})"
                )
            first_line[key] = line
            lines[loc + (key,)] = line
            _index_keys(value_node, loc + (key,), lines, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_keys(item, (*loc, str(i)), lines, source, seen)


def _format_yaml_error(exc: yaml.YAMLError, source: str) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    detail = f"{problem} ({context})" if context else problem
    return f"{source}: {where}invalid YAML: {detail}"


# --------------------------------------------------------------------------------------------
# error formatting

# What each field accepts, in words, for type and range errors.
_EXPECTED: dict[str, str] = {
    "model_dir": "a path or URL (a string) or null",
    "task": "a mapping with 'class' and optional 'params'",
    "task.class": "a string 'module:ClassName' or 'path/to/file.py:ClassName'",
    "task.params": "a mapping of keyword arguments",
    "trainer": "a mapping",
    "trainer.train_steps": "an integer >= 1 or null",
    "trainer.steps_per_loop": "an integer >= 1",
    "trainer.checkpoint_interval": "an integer >= 1 or null",
    "trainer.validation_interval": "an integer >= 1 or null",
    "trainer.validation_steps": "-1 (the whole validation data) or an integer >= 1",
    "trainer.max_to_keep": "an integer >= 0 or null",
    "trainer.keep_every_n_steps": "an integer >= 1 or null",
    "trainer.summary_interval": "an integer >= 1 or null",
    "trainer.seed": "an integer from 0 to 2**32 - 1",
    "trainer.precision": "one of '32', 'bf16', 'fp16'",
    "trainer.grad_accum_steps": "an integer >= 1",
    "trainer.grad_clip_norm": "a number > 0 or null",
    "trainer.device": "'auto', 'cpu', 'cuda' or 'cuda:N'",
    "trainer.best_checkpoint": "a mapping with 'metric' and optional 'higher_is_better', or null",
    "trainer.early_stopping": "a mapping with 'metric', 'patience', optional 'min_delta' and 'higher_is_better', or null",
    "trainer.recovery": "a mapping with optional 'loss_upper_bound', 'recovery_begin_steps', 'max_trials', or null",
    "trainer.save_on_preemption": "true or false",
    "trainer.early_stopping.patience": "an integer >= 1",
    "trainer.recovery.max_trials": "an integer >= 0",
    "export": "a mapping with optional 'formats', 'on', 'max_to_keep', or null",
    "export.formats": "a list of 'safetensors', 'torch_export', 'torchscript', 'onnx'",
    "export.on": "one of 'best', 'final', 'every_eval'",
    "sidecar": "a mapping",
    "sidecar.mode": "'every' or 'latest'",
    "sidecar.timeout": "a number of seconds >= 0, or null",
    "sidecar.max_pending": "an integer >= 1 or null",
    "sidecar.max_evaluations": "an integer >= 1 or null",
    "sidecar.max_retries": "an integer >= 0",
    "trainer.in_process_validation": "true or false",
    "callbacks": "a list of mappings with 'class' and optional 'params'",
}


def _short_repr(value: Any, limit: int = 60) -> str:
    """``repr`` for error messages, with YAML's spelling of null and booleans, shortened."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(loc: Sequence[str]) -> type[BaseModel] | None:
    """The model class holding the field at ``loc`` (a path of aliases), if in the schema."""
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list of models (callbacks.0.class)
            continue
        field = _field(model, part)
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            return None
        model = sub
    return model


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field annotated ``Model`` or ``Model | None``, else None."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _field(model: type[BaseModel], key: str) -> Any:
    """The pydantic FieldInfo for ``key`` (field name or alias) in ``model``, or None."""
    for name, info in model.model_fields.items():
        if key == name or key == info.alias:
            return info
    return None


def _field_names(model: type[BaseModel]) -> list[str]:
    """The names users write: aliases where there are aliases."""
    return [info.alias or name for name, info in model.model_fields.items()]


def _suggest(word: str, choices: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _display_path(loc: Sequence[Any]) -> str:
    """A config location as users write it: ``trainer.recovery.max_trials``, ``callbacks[0].class``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _format_error(err: Mapping[str, Any]) -> tuple[Loc, str]:
    """``(loc, "path: problem")`` for one pydantic error."""
    loc = tuple(str(p) for p in err["loc"])
    path = _display_path(err["loc"]) or "(top level)"
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc)
        hint = _suggest(loc[-1], _field_names(model)) if model is not None else None
        return loc, f"{path}: unknown field" + (f" (did you mean {hint!r}?)" if hint else "")
    if kind == "missing":
        return loc, f"{path}: required field missing"
    if kind in ("value_error", "assertion_error"):
        message = str(err.get("ctx", {}).get("error") or err["msg"]).removeprefix("Value error, ")
        if not loc:  # a rule across fields: the message names them; the input is the whole file
            return loc, message
        return loc, f"{path}: {message}, got {_short_repr(value)}"
    if path in _EXPECTED:
        return loc, f"{path}: expected {_EXPECTED[path]}, got {_short_repr(value)}"
    message = err["msg"][:1].lower() + err["msg"][1:]
    return loc, f"{path}: {message} (got {_short_repr(value)})"


def _validation_message(
    exc: ValidationError, source: str, lines: Mapping[Loc, int], overridden: Mapping[Loc, str]
) -> str:
    """One line per error, prefixed by where the value came from (file + line, or --set).

    File errors come first, in line order; then the overrides' errors.
    """
    out: list[tuple[int, float, str]] = []
    for err in exc.errors():
        loc, text = _format_error(err)
        origin = _override_for(loc, overridden)
        if origin is not None:
            out.append((1, 0, f"{origin}: {text}"))
            continue
        line = _line_for(loc, lines)
        out.append((0, line or 0, f"{source}: {text}" + (f" (line {line})" if line else "")))
    return "\n".join(text for _, _, text in sorted(out, key=lambda e: e[:2]))


def _override_for(loc: Loc, overridden: Mapping[Loc, str]) -> str | None:
    """The override that set ``loc`` or one of its parents (the last one applied wins)."""
    for i in range(len(loc), 0, -1):
        if loc[:i] in overridden:
            return overridden[loc[:i]]
    return None


def _line_for(loc: Loc, lines: Mapping[Loc, int]) -> int | None:
    for i in range(len(loc), 0, -1):
        if loc[:i] in lines:
            return lines[loc[:i]]
    return None


# --------------------------------------------------------------------------------------------
# overrides


_KEY_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Split ``dotted.key=value`` into ``(["dotted", "key"], value)``; the value is YAML.

    ``a.b=5`` gives ``5``, ``a.b=null`` gives ``None``, ``a.b=[64, 32]`` a list, ``a.b=x`` the
    string ``"x"``. A ``[N]`` after a name indexes a list, as config errors write it:
    ``callbacks[0].params.path=x`` gives ``(["callbacks", 0, "params", "path"], "x")``.
    Raises ConfigError when there is no ``=``, the key is malformed, or the value is not valid
    YAML. The key path is not checked against the schema here.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"--set {text}: expected key=value")
    parts: list[str | int] = []
    for segment in key.split("."):
        match = _KEY_PART.fullmatch(segment.strip())
        if match is None or not match.group(1).strip():
            raise ConfigError(f"--set {text}: malformed key {key!r} (expected dotted.key=value, "
                              "or name[N] for a list item)")
        parts.append(match.group(1).strip())
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"--set {text}: invalid YAML value: {problem}") from None
    return parts, value


def _check_override_path(parts: Sequence[str | int], text: str) -> list[str | int]:
    """The key path with aliases canonical (``task.class``); ConfigError if not in the schema.

    An index must follow a list field (``callbacks[0]``); a list of sections is entered
    (``callbacks[0].params``), a list of values is set item by item (``export.formats[1]``).
    """
    model: type[BaseModel] | None = ExperimentConfig
    canonical: list[str | int] = []
    items: Any = None  # the annotation of a list's items, right after its field
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if model is None and items is None:  # below a free-form mapping (task.params)
            canonical.extend(parts[i:])
            break
        if isinstance(part, int):
            if items is None:
                raise ConfigError(f"--set {text}: {_display_path(canonical)!r} is not a list (cannot index it)")
            canonical.append(part)
            model, items = _enter(items, canonical, parts, last, text)
            continue
        if model is None:  # a name right after a list field: list fields take indexes only
            raise ConfigError(f"--set {text}: {_display_path(canonical)!r} is a list: "
                              f"write {_display_path(canonical)}[N].{part} for its item N")
        field = _field(model, part)
        if field is None:
            names = _field_names(model)
            hint = _suggest(part, names)
            if hint is not None:
                problem = f"(did you mean {_display_path((*canonical, hint))!r}?)"
            else:
                problem = "(expected one of " + ", ".join(repr(_display_path((*canonical, n))) for n in names) + ")"
            unknown = _display_path(parts[: i + 1])
            raise ConfigError(f"--set {text}: unknown field {unknown!r} {problem}")
        name = next(n for n, f in model.model_fields.items() if f is field)
        canonical.append(field.alias or name)
        sub = field.annotation
        if _list_items(sub) is not None:
            model, items = None, _list_items(sub)
        else:
            items = None
            model, _ = _enter(sub, canonical, parts, last, text)
    return canonical


def _enter(annotation: Any, canonical: Sequence[str | int], parts: Sequence[str | int], last: bool,
           text: str) -> tuple[type[BaseModel] | None, Any]:
    """``(model, None)`` to go on inside a section, ``(None, None)`` inside a free-form mapping;
    ConfigError when ``annotation`` is a plain value and the key goes on below it."""
    if _submodel(annotation) is not None:
        return _submodel(annotation), None
    if _is_mapping_type(annotation) or last:
        return None, None
    raise ConfigError(
        f"--set {text}: {_display_path(canonical)!r} is a value, not a section "
        f"(cannot set {_display_path(parts)!r})"
    )


def _list_items(annotation: Any) -> Any:
    """The item annotation of a ``list[X]`` (or ``list[X] | None``) field, else None."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if getattr(candidate, "__origin__", None) is list:
            return candidate.__args__[0]
    return None


def _is_mapping_type(annotation: Any) -> bool:
    origin = getattr(annotation, "__origin__", annotation)
    return isinstance(origin, type) and issubclass(origin, Mapping)


def _apply_override(data: dict[str, Any], path: Sequence[str | int], value: Any, text: str) -> None:
    node: Any = data
    for i, part in enumerate(path):
        where = _display_path(path[:i])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(f"--set {text}: cannot set {_display_path(path)!r}: "
                                  f"{where!r} is {_short_repr(node)}, not a list")
            if part >= len(node):
                raise ConfigError(f"--set {text}: cannot set {_display_path(path)!r}: {where!r} has "
                                  f"{len(node)} item{'s' * (len(node) != 1)} (indexes from 0)")
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {text}: cannot set {_display_path(path)!r}: "
                              f"{where!r} is {_short_repr(node)}, not a mapping")
        if i == len(path) - 1:
            node[part] = value
        elif isinstance(part, int):
            node = node[part]
        else:
            if node.get(part) is None:
                node[part] = [] if isinstance(path[i + 1], int) else {}
            node = node[part]


# --------------------------------------------------------------------------------------------
# loading and saving


def _read_text(path: str) -> str:
    from cadence.storage import Storage

    try:
        storage = Storage(path)
        data = storage.read_bytes(storage.root)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except Exception as exc:  # permissions, network, unknown protocol...
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None


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
    _lines: Mapping[Loc, int] | None = None,
) -> ExperimentConfig:
    """Validate plain data (as read from YAML) into an :class:`ExperimentConfig`.

    ``overrides`` are ``dotted.key=value`` strings applied first, then ``model_dir`` (when not
    ``None``). ``source`` names the data in error messages; ``config_dir`` is recorded for
    :func:`resolve_task_class`. Raises ConfigError.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {_describe_type(data)}"
        )
    work: dict[str, Any] = _deep_copy(data)
    overridden: dict[Loc, str] = {}
    for text in overrides:
        parts, value = parse_override(text)
        path = _check_override_path(parts, text)
        _apply_override(work, path, value, text)
        overridden[tuple(str(p) for p in path)] = f"--set {text}"
    if model_dir is not None:
        work["model_dir"] = model_dir
        overridden[("model_dir",)] = f"--model-dir {model_dir}"
    try:
        cfg = ExperimentConfig.model_validate(work)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc, source, _lines or {}, overridden)) from None
    if config_dir is not None:
        cfg._config_dir = Path(config_dir).resolve()
        cfg.task.task_class = resolve_task_class(cfg)  # importable from any working directory
        for entry in cfg.callbacks:
            entry.callback_class = resolve_class_path(entry.callback_class, cfg.config_dir)
    return cfg


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(
    path: str | Path, overrides: Sequence[str] = (), model_dir: str | None = None
) -> ExperimentConfig:
    """Read, override and validate a YAML config file; raise ConfigError on any problem.

    ``overrides`` are ``dotted.key=value`` strings (value parsed as YAML), applied in order; a
    key outside the schema is an error, except below ``task.params``. ``model_dir``, when given,
    replaces the file's ``model_dir``. The file's directory is recorded (``cfg.config_dir``) so
    that a relative ``file.py:Class`` can be resolved by :func:`resolve_task_class`.
    """
    source = os.fspath(path)
    text = _read_text(source)
    data, lines = _parse_yaml(text, source)
    if data is None:
        raise ConfigError(f"{source}: the file is empty (expected a mapping with at least 'task')")
    config_dir = (
        None
        if "://" in source and not source.startswith("file://")
        else Path(source.removeprefix("file://")).parent
    )
    return config_from_dict(
        data, overrides, model_dir=model_dir, source=source, config_dir=config_dir, _lines=lines
    )


def save_config(cfg: ExperimentConfig, path_or_url: str | Path) -> None:
    """Write ``cfg.to_yaml()`` to a local path or an fsspec URL, creating parents; atomic on local disks."""
    from cadence.storage import Storage

    storage = Storage(os.fspath(path_or_url))
    storage.makedirs(posixpath.dirname(storage.root))
    storage.write_atomic(storage.root, cfg.to_yaml().encode("utf-8"))
