"""The search-space file of ``cadence sweep --space SPACE.yaml``: its schema, its loading with
one-line errors (file, key, line), the check of its keys and ranges against the experiment config,
and the Optuna distributions it describes.

.. code-block:: yaml

    params:                                   # any config key, dotted as --set writes it
      task.params.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
      task.params.hidden: {type: int, low: 32, high: 256, step: 32}
      task.params.dropout: {type: categorical, choices: [0.0, 0.1, 0.3]}
    sampler: tpe                              # or random
    seed: 0                                   # the sampler's seed; null: not seeded
    metric: accuracy                          # default: trainer.best_checkpoint.metric
    direction: maximize                       # default: from trainer.best_checkpoint.higher_is_better
    pruner: {kind: median, n_startup_trials: 2, n_warmup_steps: 100}
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from cadence.config.errors import display_path, short_repr
from cadence.config.schema import ExperimentConfig, PrunerConfig
from cadence.config.yaml_io import Loc, parse_yaml
from cadence.errors import ConfigError

__all__ = ["ParamSpec", "SweepSpace", "check_against_config", "distributions", "load_space", "set_params"]

_SET_BY_SWEEP = ("model_dir", "sweep_trial")
"""Top-level config keys ``cadence sweep`` sets for each trial: never a parameter."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ParamSpec(_Strict):
    """One parameter: ``float`` / ``int`` from ``low`` to ``high`` (both included; ``log``: sampled
    log-uniformly; ``step``: on a grid from ``low``), or ``categorical`` among ``choices``."""

    type: Literal["float", "int", "categorical"] = Field(description="float, int or categorical")
    low: float | None = Field(default=None, allow_inf_nan=False)
    high: float | None = Field(default=None, allow_inf_nan=False)
    log: StrictBool = False
    step: float | None = Field(default=None, allow_inf_nan=False)
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ParamSpec:
        if self.type == "categorical":
            given = [n for n in ("low", "high", "step") if getattr(self, n) is not None] + (["log"] if self.log else [])
            if given:
                raise ValueError(f"a categorical parameter takes choices, not {', '.join(given)}")
            if not self.choices:
                raise ValueError("a categorical parameter needs choices: a non-empty list")
            bad = [c for c in self.choices if c is not None and not isinstance(c, (bool, int, float, str))]
            if bad:
                raise ValueError(f"choices are numbers, strings, booleans or null, not {short_repr(bad[0])}")
            return self
        if self.choices is not None:
            raise ValueError(f"a {self.type} parameter takes low and high, not choices")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs low and high")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be > 0, got {self.step:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0, got {self.low:g}")
        if self.log and self.step is not None:
            raise ValueError("log: true and step exclude each other")
        if self.type == "int" and any(v is not None and v != int(v) for v in (self.low, self.high, self.step)):
            raise ValueError("an int parameter needs integer low, high and step")
        return self

    def probes(self) -> list[Any]:
        """Values this parameter may take that check the config's bounds: the ends, or every choice."""
        if self.type == "categorical":
            return list(self.choices or [])
        assert self.low is not None and self.high is not None, "checked on validation"
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


class SweepSpace(_Strict):
    """The whole space file (see the module's example)."""

    params: dict[str, ParamSpec] = Field(min_length=1)
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = Field(default=None, ge=0, strict=True)
    metric: str | None = Field(default=None, min_length=1)
    direction: Literal["maximize", "minimize"] | None = None
    pruner: PrunerConfig = Field(default_factory=PrunerConfig)


def load_space(path: str | Path) -> SweepSpace:
    """Read and validate a space file.

    Raises:
      ConfigError: the file is missing, unreadable or not YAML; a field is unknown, missing or
        invalid -- one line per problem, naming the file, the key and its line.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: space file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read the space file: {e}") from None
    data, lines = parse_yaml(text, source)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping with 'params' (the search space), got {short_repr(data)}")
    try:
        return SweepSpace.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_message(exc, source, lines)) from None


def _message(exc: ValidationError, source: str, lines: Mapping[Loc, int]) -> str:
    out = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        path = display_path(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            text = f"{path}: unknown field"
        elif err["type"] == "missing":
            text = f"{path}: required field missing"
        elif err["type"] == "value_error":
            text = f"{path}: {str(err.get('ctx', {}).get('error') or err['msg']).removeprefix('Value error, ')}"
        else:
            text = f"{path}: {err['msg'][:1].lower()}{err['msg'][1:]} (got {short_repr(err.get('input'))})"
        line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        out.append(f"{source}: {text}" + (f" (line {line})" if line else ""))
    return "\n".join(out)


def set_params(data: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the config's plain ``data`` with each dotted ``key`` set to its value (as
    ``--set key=value`` does, the value taken as is). ConfigError: a key outside the schema."""
    from cadence.config.overrides import apply_override, check_override_path, parse_override

    out = copy.deepcopy(data)
    for key, value in params.items():
        text = f"{key}=null"
        try:
            parts, _ = parse_override(text)
            path = check_override_path(parts, text)
            apply_override(out, path, value, text)
        except ConfigError as e:
            raise ConfigError(f"params.{key}: {str(e).removeprefix(f'--set {text}: ')}") from None
    return out


def check_against_config(space: SweepSpace, base: ExperimentConfig, source: str) -> None:
    """Every parameter names a config key, and the config stays valid at each end of its range
    (each choice): ConfigError (one line, naming ``source`` and the parameter) otherwise. The
    metric must be known: the space's ``metric`` or ``trainer.best_checkpoint``."""
    from cadence.config.loading import config_from_dict

    data = base.to_dict()
    for key, spec in space.params.items():
        top = key.split(".", 1)[0].split("[", 1)[0].strip()
        if top in _SET_BY_SWEEP:
            raise ConfigError(f"{source}: params.{key}: {top} is set by cadence sweep for each trial")
        for value in spec.probes():
            try:
                trial = set_params(data, {key: value})
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
            try:
                config_from_dict(trial, source="trial config", config_dir=base.config_dir)
            except ConfigError as e:
                first = str(e).splitlines()[0].removeprefix("trial config: ")
                raise ConfigError(f"{source}: params.{key}: the value {short_repr(value)} makes the config "
                                  f"invalid: {first}") from None
    if space.metric is None and base.trainer.best_checkpoint is None:
        raise ConfigError(f"{source}: metric: not set, and the config has no trainer.best_checkpoint to take it "
                          "from (set metric: and direction:, e.g. metric: accuracy)")


def distributions(space: SweepSpace) -> dict[str, Any]:
    """Optuna's distribution of each parameter, by its dotted key."""
    from cadence.sweep._optuna import require_optuna

    dist = require_optuna().distributions
    out: dict[str, Any] = {}
    for key, p in space.params.items():
        if p.type == "categorical":
            out[key] = dist.CategoricalDistribution(list(p.choices or []))
        elif p.type == "int":
            assert p.low is not None and p.high is not None
            out[key] = dist.IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
        else:
            assert p.low is not None and p.high is not None
            out[key] = dist.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    return out
