"""A property-based fuzzer of config loading, through the CLI's own path (``load_config(file,
overrides)`` and ``cadence train``): every generated config either loads or is refused with a
``ConfigError`` whose every line names where (the file or the ``--set``), never another exception,
never a traceback, never a file created.

What it generates, over every field of the schema (walked from ``ExperimentConfig``, so a new field
is fuzzed without touching this file): values of each field's type and of every other type; numbers
past any bound (negative, huge, beyond 64 bits, inf, nan); text with control characters and odd
Unicode; deep nesting, anchors, aliases and alias bombs; a section replaced by a scalar or a list.

The fast tier runs :data:`EXAMPLES` examples per property, derandomized (the same ones each run).
A longer soak: ``CADENCE_FUZZ_EXAMPLES=20000 pytest tests/unit/test_config_fuzz.py`` (random each run).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from cadence.cli.main import main
from cadence.config import load_config
from cadence.config.schema import ExperimentConfig
from cadence.errors import ConfigError

SOAK = int(os.environ.get("CADENCE_FUZZ_EXAMPLES", "0"))
EXAMPLES = SOAK or 120
FUZZ = settings(max_examples=EXAMPLES, derandomize=not SOAK, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _fields(model: type[BaseModel], prefix: str = "", seen: frozenset = frozenset()) -> list[str]:
    """The dotted key of every field of ``model``, sections entered (a list of sections as ``[0]``)."""
    out = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        out.append(key)
        kinds = [k for a in (typing.get_args(info.annotation) or (info.annotation,)) for k in (typing.get_args(a) or (a,))]
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel) and kind not in seen:
                item = "[0]" if typing.get_origin(info.annotation) is list else ""
                out += _fields(kind, f"{key}{item}.", seen | {kind})
    return out


FIELDS = sorted(set(_fields(ExperimentConfig)))
SECTIONS = [name for name, info in ExperimentConfig.model_fields.items() if name != "model_dir"]

ODD_TEXT = st.text(alphabet=st.sampled_from(["\0", "\x07", "\x1b", "\x7f", "\x85", "\u2028", "\ufeff", "\ufffe",
                                             "\ud7ff", "\U0001f600", "é", "a", ":", "#", "&", "*", "!", "%",
                                             "{", "[", "'", '"', "\\", " ", "\t", "\n", "-", "."]), max_size=12)
NUMBERS = st.one_of(st.integers(min_value=-2**80, max_value=2**80), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**300, -10**30]))
SCALARS = st.one_of(NUMBERS, st.booleans(), st.none(), ODD_TEXT, st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)
RAW_YAML = st.one_of(
    st.integers(min_value=4000, max_value=6000).map(lambda n: "9" * n),  # past Python's int-from-text limit
    st.integers(min_value=1, max_value=300).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=40, max_value=300).map(lambda n: "{a: " * n + "1" + "}" * n),
    st.sampled_from(["&a [*a]", "&a {x: *a}", "*undefined", "!!python/object:os.system x", "!!binary xyz",
                     "[&a [1,2,3,4,5,6,7,8,9], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b],"
                     " &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e]]",
                     "{a: 1, a: 2}", "- a\n- b", "'unterminated", ".inf", "-.inf", ".nan", "1e999", "0x1F", "0o17"]),
    ODD_TEXT,
)


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    """``--set key=value`` texts: a schema field (or a section, or a key below task.params) set to a
    value of any type dumped as YAML, or to raw YAML text (nesting, aliases, tags, odd characters)."""
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        key = draw(st.one_of(st.sampled_from(FIELDS), st.sampled_from(SECTIONS),
                             st.text(alphabet="abc.[]0", min_size=1, max_size=8).map(lambda k: f"task.params.{k}")))
        if draw(st.booleans()):
            value = yaml.safe_dump(draw(VALUES), default_flow_style=True, allow_unicode=True).strip()
            value = value.removesuffix("\n...").strip()
        else:
            value = draw(RAW_YAML)
        out.append(f"{key}={value}")
    return out


@st.composite
def documents(draw: st.DrawFn) -> str:
    """A config file's text: a valid base with sections replaced by any value, or raw YAML spliced in."""
    data: dict[str, typing.Any] = {"task": {"class": "no_such_module_for_fuzzing:Task"}}
    for section in draw(st.lists(st.sampled_from(SECTIONS), max_size=3, unique=True)):
        data[section] = draw(VALUES)
    text = yaml.safe_dump(data, allow_unicode=True)
    if draw(st.booleans()):
        section = draw(st.sampled_from(SECTIONS))
        text += f"{section}: {draw(RAW_YAML)}\n"
    return text


def _unnamed_lines(message: str, path: Path) -> list[str]:
    """The lines of a refusal that do not name where (the file or a ``--set``), are tracebacks or run
    on; ``["(empty)"]`` for an empty message. A good refusal has none."""
    if not message:
        return ["(empty)"]
    return [line for line in message.splitlines()
            if not line.startswith((str(path), "--set ")) or "Traceback" in line or len(line) >= 2000]


def _load(tmp_path: Path, text: str, sets: list[str]) -> tuple[ExperimentConfig | None, str, list[str]]:
    """Load ``text`` (as ``config.yaml`` in ``tmp_path``) with ``sets``: ``(config or None, the
    refusal's message or "", the files that appeared meanwhile)``; any other exception propagates."""
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    before = {p.name for p in tmp_path.iterdir()}
    try:
        cfg, message = load_config(path, overrides=sets), ""
    except ConfigError as e:
        cfg, message = None, str(e)
    return cfg, message, sorted({p.name for p in tmp_path.iterdir()} - before)


@FUZZ
@given(sets=overrides())
def test_any_override_loads_or_is_refused_naming_where(tmp_path, sets):
    cfg, message, created = _load(tmp_path, "task:\n  class: no_such_module_for_fuzzing:Task\n", sets)
    assert isinstance(cfg, ExperimentConfig) or not _unnamed_lines(message, tmp_path / "config.yaml"), message
    assert created == [], "loading created a file"


@FUZZ
@given(text=documents())
def test_any_config_file_loads_or_is_refused_naming_where(tmp_path, text):
    cfg, message, created = _load(tmp_path, text, [])
    assert isinstance(cfg, ExperimentConfig) or not _unnamed_lines(message, tmp_path / "config.yaml"), message
    assert created == [], "loading created a file"


@settings(FUZZ, max_examples=max(EXAMPLES // 4, 20))
@given(text=documents(), sets=overrides())
def test_cadence_train_exits_2_with_its_errors_alone_and_creates_nothing(tmp_path_factory, capsys, text, sets):
    """Through ``cadence train`` itself: a config that loads fails at its task (a module that does not
    exist), one that does not is refused; either way exit 2 with ``cadence: error:`` and one line per
    error naming its source, and neither the model dir nor anything else is created."""
    root = tmp_path_factory.mktemp("fuzz")
    path = root / "config.yaml"
    path.write_text(text, encoding="utf-8")
    code = main(["train", str(path), "--model-dir", str(root / "run"), "--no-progress",
                 *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("cadence: error: ") and "Traceback" not in err, err
    message = err.strip().removeprefix("cadence: error: ")
    if "task.class: cannot import module 'no_such_module_for_fuzzing'" not in message:  # it did not load
        assert not _unnamed_lines(message, path), message  # one line per error, each naming its source
    assert sorted(p.name for p in root.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("key", ["trainer", "checkpoint", "sidecar", "callbacks", "task"])
@pytest.mark.parametrize("value", ["5", "[1, 2]", "'text'", ".inf"])
def test_a_section_of_the_wrong_type_is_refused_naming_it(tmp_path, key, value):
    path = tmp_path / "config.yaml"
    path.write_text("task:\n  class: a:B\n", encoding="utf-8")
    if key == "callbacks" and value == "[1, 2]":
        value = "[1, {class: a:B}]"  # a list, of the wrong items
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides=[f"{key}={value}"])
    assert not _unnamed_lines(str(caught.value), path), str(caught.value)
    assert f"--set {key}=" in str(caught.value)
