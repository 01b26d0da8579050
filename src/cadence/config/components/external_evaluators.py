"""``evaluators:``: external evaluator commands (lm-eval-harness, a script of your own) run on each
evaluated checkpoint (:class:`cadence.sidecar.external.ExternalEvaluators` runs them as these
settings say). Every template, format and name is checked here, when the config is loaded."""

from __future__ import annotations

import shlex
import string
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from cadence.config.base import MAX_SECONDS, ConfigModel

__all__ = ["EXTERNAL_FORMATS", "TEMPLATE_FIELDS", "ExternalEvaluatorConfig", "ExternalEvaluatorsConfig",
           "split_command", "template_fields"]

ExternalFormat = Literal["none", "hf", "safetensors", "torch_export", "torchscript", "onnx"]
EXTERNAL_FORMATS: tuple[str, ...] = ("none", "hf", "safetensors", "torch_export", "torchscript", "onnx")
"""``none`` and every export format (``export.formats``'s)."""
Where = Literal["sidecar", "evaluate", "train"]

TEMPLATE_FIELDS: dict[str, str] = {
    "export_dir": "the checkpoint exported in `format` (a fresh directory, deleted after the commands)",
    "checkpoint_dir": "the committed checkpoint's directory (not with `on: [train]`: it is written after the evaluation)",
    "step": "the checkpoint's global step",
    "model_dir": "the model dir",
    "output_dir": "a fresh, empty directory of this command's run (kept: `<eval dir>/external/<name>/<step>/`)",
}
"""The fields a command, ``result`` and ``env`` value may name, as ``{field}`` (``{{``: a brace)."""

_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names in ``template``. ValueError: bad braces, a format spec or conversion,
    an index or attribute, or a field not in :data:`TEMPLATE_FIELDS`."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"bad template {template!r}: {e} (write {{{{ and }}}} for a literal brace)") from None
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            raise ValueError(f"unknown template field {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} in {template!r}; known: "
                             + ", ".join(f"{{{f}}}" for f in TEMPLATE_FIELDS))
        names.append(name)
    return names


def split_command(command: str | list[str]) -> list[str]:
    """The command's arguments: a list as is, a string split as a POSIX shell would
    (:func:`shlex.split`; no shell runs it). ValueError: empty, or unbalanced quotes."""
    if isinstance(command, str):
        try:
            argv = shlex.split(command)
        except ValueError as e:
            raise ValueError(f"command {command!r}: {e}") from None
    else:
        argv = list(command)
    if not argv or not argv[0].strip():
        raise ValueError("command is empty")
    return argv


class ExternalEvaluatorConfig(ConfigModel):
    """A command run on each evaluated checkpoint, after the built-in evaluation of its step and before
    the eval actions, in the same evaluation: its JSON result becomes metrics `<prefix>/<key>` (nested
    keys joined with `/`), so they reach `evaluations.jsonl`, the eval summaries (TensorBoard,
    `metrics.jsonl`, `cadence ls` / `report`), the trackers, `trainer.best_checkpoint`,
    `trainer.early_stopping` and sweeps. It runs without a shell, in the run's working directory;
    templates take `{export_dir}`, `{checkpoint_dir}`, `{step}`, `{model_dir}`, `{output_dir}`. A failure
    (an exit status other than 0, a timeout, no JSON result) is retried `retries` times, then recorded in
    the evaluation's record (`external.<name>`: status, exit status, last output line) and the
    evaluation goes on with the other metrics."""

    name: str = Field(
        pattern=_NAME, max_length=64,
        json_schema_extra={"expected": "a name of letters, digits, '_', '-' and '.' (not first; at most 64 characters)"},
        description="The evaluator's name, unique in `evaluators`: its record's key and its default `prefix`.",
    )
    command: str | list[str] = Field(
        json_schema_extra={"expected": "a command line (a string) or a list of arguments"},
        description=("The command: a list of arguments, or a string split as a shell would (quotes), run without a "
                     "shell (for pipes or `&&`, say `[sh, -c, '...']`). Each argument is a template."),
    )
    format: ExternalFormat = Field(
        default="none",
        description=("Export the evaluated weights in this format into `{export_dir}` first (`hf`: a `save_pretrained` "
                     "directory with the Task's tokenizer, what lm-eval's `--model hf` reads); `none`: no export "
                     "(the command reads `{checkpoint_dir}`)."),
    )
    result: str = Field(
        default="stdout", min_length=1,
        description=("Where the JSON result is: `stdout` (the last line of standard output that is a JSON object), "
                     "or a file path template, which may be a glob (the newest match is read; lm-eval writes "
                     "`{output_dir}/<model>/results_<time>.json`: `{output_dir}/**/results_*.json`)."),
    )
    select: str | None = Field(
        default=None,
        description=("The part of the JSON holding the metrics, as a `/` path (`results` for lm-eval); `null`: all "
                     "of it. Only numbers are kept; a key `metric,filter` (lm-eval's) becomes `metric` for the "
                     "filter `none`, else `metric/filter`."),
    )
    prefix: str | None = Field(
        default=None, pattern=r"^[^/].*[^/]$|^[^/]$",
        json_schema_extra={"expected": "a metric name prefix (not starting or ending with '/')"},
        description="The metrics' prefix: `<prefix>/<key>` (`lm_eval/<task>/acc`); `null`: `name`.",
    )
    timeout_s: float = Field(
        default=3600.0, gt=0, le=MAX_SECONDS,
        description="Seconds an attempt may run; then its process group is killed and the attempt failed.",
    )
    retries: int = Field(
        default=1, ge=0, le=10, strict=True,
        description="A failed attempt is retried this many times (each in a fresh `{output_dir}`), then recorded.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables added to the command's (values are templates).",
    )
    on: list[Where] = Field(
        default_factory=lambda: list[Where](["sidecar", "evaluate"]),
        min_length=1,
        description=("Which evaluations run it: `sidecar` (`cadence evaluate --continuous`, `launch --sidecar`), "
                     "`evaluate` (`cadence evaluate --checkpoint`, `--initial`), `train` (the in-process evaluations of "
                     "`cadence train`, not its sanity check: every rank waits for the command, so it is off by "
                     "default; `trainer.early_stopping` sees the metrics only so)."),
    )

    @field_validator("command", mode="before")
    @classmethod
    def _string_or_list_of_strings(cls, value: object) -> object:
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(a, str) for a in value)):
            return value
        raise ValueError("expected a command line (a string) or a list of arguments")  # one message for the union

    @field_validator("command")
    @classmethod
    def _command_templates(cls, value: str | list[str]) -> str | list[str]:
        for argument in split_command(value):
            template_fields(argument)
        return value

    @field_validator("result")
    @classmethod
    def _result_template(cls, value: str) -> str:
        if value != "stdout":
            template_fields(value)
        return value

    @field_validator("env")
    @classmethod
    def _env_templates(cls, value: dict[str, str]) -> dict[str, str]:
        for name, template in value.items():
            if not name or "=" in name:
                raise ValueError(f"bad environment variable name {name!r}")
            template_fields(template)
        return value

    @model_validator(mode="after")
    def _fields_available(self) -> ExternalEvaluatorConfig:
        used = {f for a in split_command(self.command) for f in template_fields(a)}
        used |= {f for t in self.env.values() for f in template_fields(t)}
        used |= set(template_fields(self.result)) if self.result != "stdout" else set()
        if "export_dir" in used and self.format == "none":
            raise ValueError(f"evaluator {self.name!r}: {{export_dir}} needs a format (format is 'none': nothing is exported)")
        if "checkpoint_dir" in used and "train" in self.on:
            raise ValueError(f"evaluator {self.name!r}: {{checkpoint_dir}} is not known in-process (on: train): a "
                             "step's checkpoint is written after its evaluation; export a format instead")
        return self

    @property
    def metric_prefix(self) -> str:
        """``prefix``, else ``name``."""
        return self.prefix if self.prefix is not None else self.name


def _unique_names(evaluators: list[ExternalEvaluatorConfig]) -> list[ExternalEvaluatorConfig]:
    names = [e.name for e in evaluators]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"evaluator names must be unique: {', '.join(repr(n) for n in twice)} given more than once")
    return evaluators


ExternalEvaluatorsConfig = Annotated[list[ExternalEvaluatorConfig], AfterValidator(_unique_names)]
"""``evaluators:``: the list, with unique names."""
