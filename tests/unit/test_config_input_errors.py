"""Inputs that YAML or Python refuse while a config is read: one line naming the file (or the
``--set``), the line and column, and the key where there is one; exit 2 from the CLI, no traceback,
nothing created."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.cli.main import main
from cadence.config import config_from_dict, load_config
from cadence.errors import ConfigError

HUGE = "9" * 5000


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_an_integer_too_long_for_python_names_its_key_and_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(f"task:\n  class: a:B\ntrainer:\n  seed: {HUGE}\n")
    assert refused(path) == (f"{path}: line 4, column 9: trainer.seed: invalid YAML: an integer of 5,000 "
                             "characters is too long (at most 4300 digits)")
    with pytest.raises(ConfigError, match=r"^--set trainer\.seed=9+\.\.\.: line 1, column 1: invalid YAML: an integer "
                                          r"of 5,000 characters is too long \(at most 4300 digits\)$"):
        config_from_dict({"task": {"class": "a:B"}}, [f"trainer.seed={HUGE}"])


@pytest.mark.parametrize("char", ["\0", "\x07", "\x1b", "\ufffe"])
def test_a_control_character_names_the_file_line_column_and_key(tmp_path, char):
    path = tmp_path / "config.yaml"
    path.write_text(f"task:\n  class: a:B\nbest_checkpoint:\n  metric: accu{char}racy\n")
    assert refused(path) == (f"{path}: line 4, column 15: best_checkpoint.metric: invalid YAML: the character "
                             f"{char!r} is not allowed (a control character)")


def test_a_control_character_in_yaml_that_is_broken_anyway_still_names_the_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("task: [\n\0")
    assert refused(path) == f"{path}: line 2, column 1: invalid YAML: the character '\\x00' is not allowed (a control character)"


def test_deep_nesting_in_a_file_names_the_line_and_column_of_the_level_too_many(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("task:\n  class: a:B\n  params:\n    x: " + "[" * 60 + "\n")
    assert refused(path) == f"{path}: line 4, column 58: values nested too deeply (at most 50 levels)"


@pytest.mark.parametrize("text", [f"trainer:\n  seed: {HUGE}\n", "best_checkpoint:\n  metric: accu\0racy\n",
                                  "  params:\n    x: " + "{a: " * 60 + "1" + "}" * 60 + "\n"],
                         ids=["huge-int", "nul", "deep"])
def test_the_cli_exits_2_with_one_line_and_creates_nothing(tmp_path, capsys, text):
    path = tmp_path / "config.yaml"
    path.write_text("task:\n  class: a:B\n" + text)
    run = tmp_path / "run"
    assert main(["train", str(path), "--model-dir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"cadence: error: {path}: line ") and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("override", ["sidecar.lease_ttl=.inf", "sidecar.poll_interval=.inf", "sidecar.lease_ttl=1e300",
                                      "sidecar.timeout=.nan", "checkpoint.writer_lease_ttl=1e12",
                                      "eval_spec.throttle_secs=-.inf", "trainer.hang_timeout=.inf",
                                      "trainer.early_stopping={metric: loss, patience: 2, min_delta: .nan}",
                                      "sidecar.max_retries=10000", f"trainer.train_steps={'9' * 40}"])
@pytest.mark.parametrize("command", [["train"], ["evaluate", "--continuous"]], ids=["train", "sidecar"])
def test_non_finite_and_absurd_numbers_are_refused_at_load_and_nothing_is_created(tmp_path, capsys, override,
                                                                                   command):
    path = tmp_path / "config.yaml"
    path.write_text("task:\n  class: a:B\n")
    run = tmp_path / "run"
    assert main([command[0], str(path), *command[1:], "--model-dir", str(run), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"cadence: error: --set {override.split('=')[0]}=") and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_every_duration_of_the_schema_is_bounded():
    """Every float field of every section is finite (``allow_inf_nan=False`` on the base model), and
    each one in seconds is at most MAX_SECONDS."""
    import typing

    from pydantic import BaseModel

    from cadence.config.base import MAX_SECONDS
    from cadence.config.schema import ExperimentConfig

    seen: set[type] = set()
    durations = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        if model in seen:
            return
        seen.add(model)
        assert model.model_config.get("allow_inf_nan") is False, model
        for name, info in model.model_fields.items():
            kinds = [k for a in (typing.get_args(info.annotation) or (info.annotation,))
                     for k in (typing.get_args(a) or (a,))]
            for kind in kinds:
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    walk(kind, f"{prefix}{name}.")
            if float in kinds and "second" in (info.description or "").lower():
                durations.append(f"{prefix}{name}")
                assert any(getattr(m, "le", None) == MAX_SECONDS for m in info.metadata), f"{prefix}{name}"

    walk(ExperimentConfig, "")
    assert {"sidecar.lease_ttl", "sidecar.poll_interval", "sidecar.timeout", "checkpoint.writer_lease_ttl",
            "trainer.hang_timeout"} <= set(durations)
