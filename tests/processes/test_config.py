"""The experiment config: loading, defaults, overrides, round trips, and the error messages."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.config import (
    ExperimentConfig,
    TrainerConfig,
    config_from_dict,
    load_config,
    parse_override,
    resolve_task_class,
    save_config,
)
from cadence.errors import ConfigError

VALID = """\
model_dir: runs/digits
task:
  class: examples.digits.task:DigitsTask
  params: {hidden: 64}
trainer:
  train_steps: 600
  steps_per_loop: 50
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path | str, overrides: tuple[str, ...] = (), **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, **kw)  # type: ignore[arg-type]
    message = str(info.value)
    assert (
        "Traceback" not in message
        and "pydantic" not in message
        and "errors.pydantic.dev" not in message
    )
    assert info.value.__cause__ is None  # raised "from None": no chained traceback either
    assert info.value.__context__ is None or info.value.__suppress_context__
    return message


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    return write(tmp_path, VALID)


# -- valid configs ---------------------------------------------------------------------------


def test_valid_file_loads_with_defaults(cfg_path: Path) -> None:
    cfg = load_config(cfg_path)
    assert cfg.model_dir == "runs/digits"
    assert cfg.task.class_path == "examples.digits.task:DigitsTask"
    assert cfg.task.params == {"hidden": 64}
    t = cfg.trainer
    assert (t.train_steps, t.steps_per_loop) == (600, 50)
    defaults = TrainerConfig()
    for name in (
        "checkpoint_interval",
        "validation_interval",
        "validation_steps",
        "max_to_keep",
        "keep_every_n_steps",
        "summary_interval",
        "seed",
        "precision",
        "grad_accum_steps",
        "grad_clip_norm",
        "device",
    ):
        assert getattr(t, name) == getattr(defaults, name)
    assert (t.validation_steps, t.precision, t.device, t.grad_accum_steps) == (-1, "32", "auto", 1)
    assert cfg.config_dir == cfg_path.parent.resolve()


def test_minimal_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "task:\n  class: pkg.mod:Task\ntrainer:\n"))
    assert cfg.model_dir is None and cfg.task.params == {} and cfg.trainer == TrainerConfig()


def test_model_dir_argument_wins(cfg_path: Path) -> None:
    cfg = load_config(cfg_path, ["model_dir=elsewhere"], model_dir="/tmp/run")
    assert cfg.model_dir == "/tmp/run"


@pytest.mark.parametrize("value", [32, "32", " 32 "])
def test_precision_normalised(tmp_path: Path, value: object) -> None:
    cfg = config_from_dict({"task": {"class": "m:T"}, "trainer": {"precision": value}})
    assert cfg.trainer.precision == "32"
    assert (
        load_config(write(tmp_path, VALID), ["trainer.precision=BF16"]).trainer.precision == "bf16"
    )


def test_summary_interval_multiple_rule(cfg_path: Path) -> None:
    assert load_config(cfg_path, ["trainer.summary_interval=100"]).trainer.summary_interval == 100
    message = error_of(cfg_path, ("trainer.summary_interval=75",))
    assert (
        "trainer.summary_interval" in message
        and "multiple of trainer.steps_per_loop (50)" in message
    )
    # the rule follows an overridden steps_per_loop
    assert load_config(cfg_path, ["trainer.steps_per_loop=25", "trainer.summary_interval=75"])


# -- overrides -------------------------------------------------------------------------------


def test_overrides(cfg_path: Path) -> None:
    cfg = load_config(
        cfg_path,
        [
            "trainer.train_steps=100",
            "trainer.grad_clip_norm=1e-3",
            "trainer.checkpoint_interval=null",
            "trainer.device=cuda:1",
            "task.class=other.module:Other",
            "task.params.hidden=[64, 32]",
            "task.params.optim.lr=0.1",
            "task.params.name=a=b",
        ],
    )
    assert cfg.trainer.train_steps == 100
    assert cfg.trainer.grad_clip_norm == 1e-3
    assert cfg.trainer.checkpoint_interval is None
    assert cfg.trainer.device == "cuda:1"
    assert cfg.task.class_path == "other.module:Other"
    assert cfg.task.params == {"hidden": [64, 32], "optim": {"lr": 0.1}, "name": "a=b"}


def test_override_whole_sections(cfg_path: Path) -> None:
    cfg = load_config(
        cfg_path, ["task.params={a: 1}", "trainer={train_steps: 7}", "task.class_path=x:Y"]
    )
    assert cfg.task.params == {"a": 1}
    assert (
        cfg.trainer.train_steps == 7
        and cfg.trainer.steps_per_loop == TrainerConfig().steps_per_loop
    )
    assert cfg.task.class_path == "x:Y"


def test_parse_override() -> None:
    assert parse_override("a.b=5") == (["a", "b"], 5)
    assert parse_override("a= null") == (["a"], None)
    assert parse_override("a=[1,2]") == (["a"], [1, 2])
    assert parse_override("a=hello") == (["a"], "hello")
    assert parse_override("a=") == (["a"], None)


# -- errors ----------------------------------------------------------------------------------


def test_unknown_field_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("train_steps", "train_stpes"))
    message = error_of(path)
    assert message == (
        f"{path}: trainer.train_stpes: unknown field (did you mean 'train_steps'?) (line 6)"
    )


def test_unknown_top_level_field(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, VALID.replace("model_dir", "modeldir")))
    assert "modeldir: unknown field (did you mean 'model_dir'?)" in message


def test_type_error_message(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("train_steps: 600", "train_steps: abc"))
    assert error_of(path) == (
        f"{path}: trainer.train_steps: expected an integer >= 1 or null, got 'abc' (line 6)"
    )


def test_all_errors_one_per_line(tmp_path: Path) -> None:
    text = (
        VALID
        + "  seed: -1\n  precision: fp8\n  device: gpu\n  grad_clip_norm: 0\n  max_to_keep: yes\n"
    )
    path = write(tmp_path, text.replace("steps_per_loop: 50", "steps_per_loop: 0"))
    lines = error_of(path).splitlines()
    assert lines == [
        f"{path}: trainer.steps_per_loop: expected an integer >= 1, got 0 (line 7)",
        f"{path}: trainer.seed: expected an integer from 0 to 2**32 - 1, got -1 (line 8)",
        f"{path}: trainer.precision: expected one of '32', 'bf16', 'fp16', got 'fp8' (line 9)",
        f"{path}: trainer.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu' (line 10)",
        f"{path}: trainer.grad_clip_norm: expected a number > 0 or null, got 0 (line 11)",
        f"{path}: trainer.max_to_keep: expected an integer >= 0 or null, got 'yes' (line 12)",
    ]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (
            "validation_steps",
            "0",
            "trainer.validation_steps: expected -1 (the whole validation data) "
            "or an integer >= 1, got 0",
        ),
        ("train_steps", "1.5", "trainer.train_steps: expected an integer >= 1 or null, got 1.5"),
        ("train_steps", "true", "trainer.train_steps: expected an integer >= 1 or null, got true"),
        (
            "grad_accum_steps",
            "null",
            "trainer.grad_accum_steps: expected an integer >= 1, got null",
        ),
        (
            "grad_clip_norm",
            ".inf",
            "trainer.grad_clip_norm: expected a number > 0 or null, got inf",
        ),
        (
            "keep_every_n_steps",
            "0",
            "trainer.keep_every_n_steps: expected an integer >= 1 or null, got 0",
        ),
    ],
)
def test_field_errors_from_overrides(cfg_path: Path, field: str, value: str, expected: str) -> None:
    assert (
        error_of(cfg_path, (f"trainer.{field}={value}",))
        == f"--set trainer.{field}={value}: {expected}"
    )


def test_unknown_override_key(cfg_path: Path) -> None:
    assert error_of(cfg_path, ("trainer.steps=5",)) == (
        "--set trainer.steps=5: unknown field 'trainer.steps' (did you mean 'trainer.train_steps'?)"
    )
    message = error_of(cfg_path, ("trainer.zzz=5",))
    assert message.startswith("--set trainer.zzz=5: unknown field 'trainer.zzz' (expected one of ")
    assert "'trainer.train_steps'" in message
    assert "unknown field 'traner' (did you mean 'trainer'?)" in error_of(
        cfg_path, ("traner.seed=1",)
    )


def test_override_without_equals(cfg_path: Path) -> None:
    assert (
        error_of(cfg_path, ("trainer.train_steps",))
        == "--set trainer.train_steps: expected key=value"
    )


def test_override_bad_yaml_and_bad_key(cfg_path: Path) -> None:
    assert error_of(cfg_path, ("task.params.x=[1",)).startswith(
        "--set task.params.x=[1: line 1, column 3: invalid YAML: expected ',' or ']'"
    )
    assert "malformed key" in error_of(cfg_path, ("trainer..seed=1",))
    assert "'trainer.seed' is a value, not a section" in error_of(cfg_path, ("trainer.seed.x=1",))


def test_override_inside_non_mapping_param(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("{hidden: 64}", "{hidden: [64]}"))
    message = error_of(path, ("task.params.hidden.size=3",))
    assert message.startswith(
        "--set task.params.hidden.size=3: cannot set 'task.params.hidden.size'"
    )


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    path = write(tmp_path, "task:\n  class: a:B\n trainer: 1\n")
    message = error_of(path)
    assert message.startswith(f"{path}: line 3, column 2: invalid YAML:")
    assert "\n" not in message


def test_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path, "task:\n  class: a:B\ntrainer:\n  seed: 1\n  seed: 2\n")
    assert error_of(path) == f"{path}: line 5: duplicate key 'trainer.seed' (first set on line 4)"


def test_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    assert error_of(path) == f"{path}: config file not found"


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "- 1\n- 2\n")
    assert error_of(path) == f"{path}: expected a mapping at the top level, got a list"
    empty = write(tmp_path, "# nothing\n", "empty.yaml")
    assert "the file is empty" in error_of(empty)


def test_section_not_a_mapping(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "task:\n  class: a:B\ntrainer: 5\n"))
    assert "trainer: expected a mapping, got 5 (line 3)" in message


def test_task_class_form(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("examples.digits.task:DigitsTask", "DigitsTask"))
    assert error_of(path) == (
        f"{path}: task.class: expected 'module:ClassName' or 'path/to/file.py:ClassName', "
        "got 'DigitsTask' (line 3)"
    )
    missing = write(tmp_path, "task:\n  params: {}\n", "missing.yaml")
    assert error_of(missing) == f"{missing}: task.class: required field missing (line 1)"
    assert error_of(missing, ("task.class=nope",)) == (
        "--set task.class=nope: task.class: expected 'module:ClassName' or "
        "'path/to/file.py:ClassName', got 'nope'"
    )


def test_config_from_dict_errors() -> None:
    with pytest.raises(ConfigError, match=r"^config: task: required field missing$"):
        config_from_dict({})
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got a string"):
        config_from_dict("x")  # type: ignore[arg-type]


# -- task class paths, YAML round trip --------------------------------------------------------


def test_relative_py_class_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "exp"
    sub.mkdir()
    path = write(sub, VALID.replace("examples.digits.task:DigitsTask", "models/task.py:MyTask"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("exp") / "config.yaml")
    expected = f"{sub.resolve() / 'models' / 'task.py'}:MyTask"
    assert cfg.task.class_path == expected  # resolved against the config file's directory
    assert resolve_task_class(cfg) == expected
    # a config built in code: relative to config_dir if given, else the working directory
    raw = config_from_dict({"task": {"class": "models/task.py:MyTask"}})
    assert raw.task.class_path == "models/task.py:MyTask"
    assert resolve_task_class(raw) == f"{tmp_path.resolve() / 'models' / 'task.py'}:MyTask"
    assert resolve_task_class(raw, "/elsewhere") == (
        f"{os.path.abspath('/elsewhere/models/task.py')}:MyTask"
    )
    via_dir = config_from_dict({"task": {"class": "models/task.py:MyTask"}}, config_dir=sub)
    assert via_dir.task.class_path == expected and via_dir.config_dir == sub.resolve()
    # the saved config works from anywhere
    out = tmp_path / "model_dir" / "config.yaml"
    save_config(cfg, out)
    monkeypatch.chdir("/")
    again = load_config(out)
    assert again.task.class_path == expected
    assert resolve_task_class(again) == expected
    assert path.exists()


def test_module_class_unchanged(cfg_path: Path) -> None:
    cfg = load_config(cfg_path)
    assert resolve_task_class(cfg, "/x") == "examples.digits.task:DigitsTask"


def test_to_yaml_round_trip(cfg_path: Path, tmp_path: Path) -> None:
    cfg = load_config(
        cfg_path,
        ["task.params.layers=[1, 2]", "trainer.precision=32", "trainer.grad_clip_norm=0.5"],
    )
    text = cfg.to_yaml()
    assert "class: examples.digits.task:DigitsTask" in text and "task_class" not in text
    assert "precision: '32'" in text
    out = tmp_path / "out" / "config.yaml"
    save_config(cfg, out)
    assert out.read_text() == text
    again = load_config(out)
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()
    assert not list(out.parent.glob("*.tmp"))


def test_to_yaml_keeps_special_values(tmp_path: Path) -> None:
    params = {"inf": float("-inf"), "sci": "1e5", "tup": (1, 2), "when": "2020-01-02", "n": None}
    cfg = config_from_dict({"task": {"class": "m:T", "params": params}})
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").task.params == {**params, "tup": [1, 2]}
    with pytest.raises(ConfigError, match=r"^task.params.obj: object values cannot be written"):
        config_from_dict({"task": {"class": "m:T", "params": {"obj": object()}}}).to_yaml()


def test_save_config_fsspec(cfg_path: Path, tmp_path: Path) -> None:
    cfg = load_config(cfg_path)
    url = f"memory://cadence-config-test/{tmp_path.name}/config.yaml"
    save_config(cfg, url)
    assert load_config(url) == cfg


_ints = st.one_of(st.none(), st.integers(1, 10**6))


@settings(max_examples=50, deadline=None)
@given(
    train_steps=_ints,
    steps_per_loop=st.integers(1, 100),
    loops=st.one_of(st.none(), st.integers(1, 10)),
    clip=st.one_of(st.none(), st.floats(1e-6, 1e6)),
    precision=st.sampled_from(["32", "bf16", "fp16"]),
    params=st.dictionaries(
        st.text(min_size=1, max_size=5),
        st.one_of(
            st.integers(),
            st.text(),
            st.booleans(),
            st.floats(allow_nan=False),
            st.sampled_from(["1e5", "-2.5E-3", "null", "yes", "0x1f", "12:30", "a: b"]),
        ),
    ),
)
def test_round_trip_property(
    train_steps: int | None,
    steps_per_loop: int,
    loops: int | None,
    clip: float | None,
    precision: str,
    params: dict,
) -> None:
    cfg = config_from_dict(
        {
            "task": {"class": "pkg.mod:Task", "params": params},
            "trainer": {
                "train_steps": train_steps,
                "steps_per_loop": steps_per_loop,
                "summary_interval": None if loops is None else loops * steps_per_loop,
                "grad_clip_norm": clip,
                "precision": precision,
            },
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        save_config(cfg, path)
        assert load_config(path) == cfg


def test_descriptions_for_every_field() -> None:
    from cadence.cli.docgen import config_sections

    for section in config_sections():
        for name, info in section.model.model_fields.items():
            assert info.description, f"{section.model.__name__}.{name} has no description"
    schema = ExperimentConfig.model_json_schema(by_alias=True)
    assert "class" in schema["$defs"]["ClassSpec"]["properties"]


def test_yaml_1_2_booleans_so_export_on_is_a_key(tmp_path: Path) -> None:
    text = VALID + "  best_checkpoint: {metric: accuracy}\nexport:\n  on: best\n  formats: [onnx]\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.export is not None and cfg.export.on == "best" and cfg.export.formats == ["onnx"]
    assert load_config(write(tmp_path, cfg.to_yaml())).export == cfg.export


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "1", "'true'"])
def test_only_true_and_false_are_booleans_in_every_boolean_setting(tmp_path: Path, word: str) -> None:
    from cadence.cli.docgen import config_sections

    booleans = [f"{section.path}.{name}" for section in config_sections()
                for name, info in section.model.model_fields.items() if info.annotation is bool]
    assert {"trainer.save_on_preemption", "trainer.early_stopping.higher_is_better"} <= set(booleans)
    config = write(tmp_path, VALID + "  early_stopping: {metric: accuracy}\n  best_checkpoint: {metric: accuracy}\n")
    for key in booleans:
        message = error_of(config, (f"{key}={word}",))
        assert f"{key}: expected true or false" in message, message


@pytest.mark.parametrize("text, value", [("", "auto"), ("async_save: auto", "auto"), ("async_save: true", True),
                                         ("async_save: false", False)])
def test_async_save_is_true_false_or_auto_by_default(tmp_path: Path, text: str, value: object) -> None:
    cfg = load_config(write(tmp_path, VALID + (f"checkpoint:\n  {text}\n" if text else "")))
    assert cfg.checkpoint.async_save == value and type(cfg.checkpoint.async_save) is type(value)


@pytest.mark.parametrize("word", ["yes", "'true'", "Auto", "1", "null"])
def test_a_bad_async_save_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], word: str) -> None:
    from cadence.cli.main import main

    config = write(tmp_path, VALID)
    shown = {"yes": "'yes'", "'true'": "'true'", "Auto": "'Auto'", "1": "1", "null": "null"}[word]
    assert error_of(config, (f"checkpoint.async_save={word}",)) == (
        f"--set checkpoint.async_save={word}: checkpoint.async_save: expected true, false or 'auto', got {shown}")
    run = tmp_path / "run"
    assert main(["train", str(config), "--model-dir", str(run), "--set", f"checkpoint.async_save={word}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"cadence: error: --set checkpoint.async_save={word}: checkpoint.async_save: expected true, "
                   f"false or 'auto', got {shown}"), err
    assert not run.exists()


def test_export_on_best_needs_best_checkpoint(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, VALID + "export: {on: best}\n"))
    assert "export.on is 'best' but trainer.best_checkpoint is not set" in message
    assert "got {" not in message  # a cross-field rule does not dump the whole input


# -- list items in overrides --------------------------------------------------------------------

CALLBACKS = """
callbacks:
  - class: pkg.mod:First
    params: {path: a.json}
  - class: pkg.mod:Second
export:
  formats: [safetensors, torch_export]
  on: final
"""


def test_parse_override_list_indexes() -> None:
    assert parse_override("callbacks[1].params.x=2") == (["callbacks", 1, "params", "x"], 2)
    assert parse_override("task.params.grid[0][2]=5") == (["task", "params", "grid", 0, 2], 5)
    for bad in ("callbacks[x].y=1", "callbacks[-1].y=1", "[0].y=1", "callbacks[0.y=1"):
        with pytest.raises(ConfigError, match="malformed key"):
            parse_override(bad)


def test_override_a_field_inside_one_list_item(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + CALLBACKS)
    cfg = load_config(path, ["callbacks[1].params.path=b.json", "callbacks[0].class=pkg.mod:Other",
                             "export.formats[1]=onnx", "task.params.sizes=[1, 2]", "task.params.sizes[1]=7"])
    assert [(c.class_path, c.params) for c in cfg.callbacks] == [
        ("pkg.mod:Other", {"path": "a.json"}), ("pkg.mod:Second", {"path": "b.json"})]
    assert cfg.export.formats == ["safetensors", "onnx"]
    assert cfg.task.params["sizes"] == [1, 7]


def test_list_item_override_errors_name_the_item(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + CALLBACKS)
    assert error_of(path, ("callbacks[2].params.x=1",)) == (
        "--set callbacks[2].params.x=1: cannot set 'callbacks[2].params.x': 'callbacks' has 2 items (indexes from 0)")
    assert error_of(path, ("callbacks[0].klass=x:Y",)) == (
        "--set callbacks[0].klass=x:Y: unknown field 'callbacks[0].klass' (did you mean 'callbacks[0].class'?)")
    assert error_of(path, ("callbacks.params.x=1",)).startswith(
        "--set callbacks.params.x=1: 'callbacks' is a list: write callbacks[N].params")
    assert error_of(path, ("trainer[0].seed=1",)) == "--set trainer[0].seed=1: 'trainer' is not a list (cannot index it)"
    assert "'export.formats[0]' is a value, not a section" in error_of(path, ("export.formats[0].x=1",))
    assert error_of(path, ("callbacks[0].class=nope",)).startswith("--set callbacks[0].class=nope: callbacks[0].class:")
    assert error_of(write(tmp_path, VALID, "none.yaml"), ("callbacks[0].class=a:B",)) == (
        "--set callbacks[0].class=a:B: cannot set 'callbacks[0].class': 'callbacks' has 0 items (indexes from 0)")


# ------------------------------------------------------------------ messages derived from the schema


def _leaf_fields() -> list[tuple[str, object]]:
    """``(--set path, field)`` of every field that holds a value rather than a section: plain
    values, lists of values (``export.formats``), free-form mappings (``task.params``), and the
    fields of list items (``callbacks[0].class``)."""
    from cadence.config.errors import submodel
    from cadence.cli.docgen import config_sections, yaml_key

    leaves = []
    for section in config_sections():
        if "*" in section.path:  # values of a mapping of sections: none in the schema today
            continue
        for name, info in section.model.model_fields.items():
            items = [a for a in getattr(info.annotation, "__args__", ()) if submodel(a) is not None]
            if submodel(info.annotation) is not None or items:
                continue
            prefix = section.path.replace("[]", "[0]")
            key = yaml_key(name, info)
            leaves.append((f"{prefix}.{key}" if prefix else key, info))
    return leaves


LEAVES = _leaf_fields()


def test_the_leaves_cover_every_kind_of_field() -> None:
    paths = [path for path, _ in LEAVES]
    for path in ("model_dir", "task.class", "task.params", "trainer.seed", "trainer.best_checkpoint.metric",
                 "checkpoint.async_save", "eval_spec.throttle_secs", "sidecar.max_retries", "export.formats",
                 "callbacks[0].class", "callbacks[0].params"):
        assert path in paths
    assert len(paths) == len(set(paths)) > 40


@pytest.mark.parametrize(("path", "info"), LEAVES, ids=[p for p, _ in LEAVES])
def test_every_field_says_what_it_expects_in_one_shape(path, info) -> None:
    """A wrong value in any field reads `path: expected <words from the schema>, got <value>`."""
    from cadence.config.errors import expected

    words = expected(info)
    assert words and "value of type" not in words  # described, not the fallback
    bad, shown = ("5", "5") if "mapping" in words else ("{bad: 1}", "{'bad': 1}")
    data = {"model_dir": "m", "task": {"class": "a:B"}, "callbacks": [{"class": "a:B"}],
            "evaluators": [{"name": "e", "command": "x"}]}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, [f"{path}={bad}"])
    line = f"--set {path}={bad}: {path}: expected {words}, got {shown}"
    assert line in str(caught.value).splitlines()  # beside it: a section's required fields, missing


def test_sibling_fields_get_messages_of_the_same_shape() -> None:
    data = {"model_dir": "m", "task": {"class": "a:B"}}
    messages = []
    for override in ("trainer.seed=abc", "eval_spec.throttle_secs=abc", "sidecar.lease_ttl=abc"):
        with pytest.raises(ConfigError) as caught:
            config_from_dict(data, [override])
        messages.append(str(caught.value))
    assert messages == [
        "--set trainer.seed=abc: trainer.seed: expected an integer from 0 to 2**32 - 1, got 'abc'",
        "--set eval_spec.throttle_secs=abc: eval_spec.throttle_secs: expected a number from 0 to 31622400, got 'abc'",
        "--set sidecar.lease_ttl=abc: sidecar.lease_ttl: expected a number > 0 and <= 31622400, got 'abc'",
    ]


def test_sections_and_list_items_say_what_they_hold() -> None:
    data = {"model_dir": "m", "task": {"class": "a:B"}}
    cases = {
        "trainer.early_stopping=5": "trainer.early_stopping: expected a mapping with 'metric', 'patience' and "
                                    "optional 'min_delta', 'higher_is_better', or null, got 5",
        "task=5": "task: expected a mapping with 'class' and optional 'params', 'init_from_pretrained', got 5",
        "trainer=5": "trainer: expected a mapping, got 5",
        "export={formats: [x]}": "export.formats[0]: expected one of 'safetensors', 'torch_export', "
                                 "'torchscript', 'onnx', 'hf', got 'x'",
        "callbacks=[{class: 5}]": "callbacks[0].class: expected a string 'module:ClassName' or "
                                  "'path/to/file.py:ClassName', got 5",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            config_from_dict(data, [override])
        assert str(caught.value) == f"--set {override}: {message}"


@pytest.mark.parametrize(("old", "new"), [("trainer.async_checkpoint", "checkpoint.async_save"),
                                          ("trainer.throttle_secs", "eval_spec.throttle_secs"),
                                          ("trainer.start_delay_secs", "eval_spec.start_delay_secs")])
def test_a_moved_key_names_its_new_place(tmp_path: Path, old: str, new: str) -> None:
    key = old.split(".")[1]
    path = tmp_path / "config.yaml"
    path.write_text(f"model_dir: m\ntask:\n  class: a:B\ntrainer:\n  train_steps: 5\n  {key}: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: {old}: moved to {new} (line 6)"
    path.write_text("model_dir: m\ntask:\n  class: a:B\n")
    with pytest.raises(ConfigError, match=rf"^--set {old}=1: {old}: moved to {new}$"):
        load_config(path, [f"{old}=1"])
    cfg = load_config(path, [f"{new}=true" if "async" in new else f"{new}=1"])
    section, field = new.split(".")
    assert getattr(getattr(cfg, section), field) == 1  # true == 1 for async_save


# ------------------------------------------------------------------ bombs and deep values (issue 12)

BOMB = """\
model_dir: {model_dir}
task:
  class: a:B
  params:
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB.format(model_dir=tmp_path / "run"))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb.yaml: line \d+: the values expand to more than 100,000 \(an alias bomb\?\)"):
        load_config(path)
    assert time.perf_counter() - start < 1.0


def test_a_shared_alias_within_bounds_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("task:\n  class: a:B\n  params:\n    base: &base {lr: 0.1, sizes: [1, 2]}\n    copy: *base\n")
    assert load_config(path).task.params == {"base": {"lr": 0.1, "sizes": [1, 2]}, "copy": {"lr": 0.1, "sizes": [1, 2]}}


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "self.yaml"
    path.write_text("task:\n  class: a:B\n  params: &p\n    self: *p\n")
    with pytest.raises(ConfigError, match=r"self.yaml: line \d+: an alias refers to a value that contains it"):
        load_config(path)


@pytest.mark.parametrize("value", ["[" * 5000, "[" * 3000 + "]" * 3000, "{a: " * 60 + "1" + "}" * 60])
def test_deep_values_are_refused_in_one_short_line(value: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"task": {"class": "a:B"}}, [f"task.params.x={value}"])
    message = str(caught.value)
    assert message.endswith(": values nested too deeply (at most 50 levels)") and "\n" not in message
    assert message.startswith("--set task.params.x=") and len(message) < 200
    assert time.perf_counter() - start < 1.0
    deep_file = config_from_dict({"task": {"class": "a:B", "params": {"s": "[" * 80}}})  # in a string: fine
    assert deep_file.task.params["s"] == "[" * 80


@pytest.mark.parametrize("name", ["../../escape", "a/b", "has space", ".hidden", "x" * 65])
def test_a_sidecar_name_must_be_a_plain_name(name: str) -> None:
    with pytest.raises(ConfigError, match=r"sidecar.name: expected a name of letters, digits"):
        config_from_dict({"task": {"class": "a:B"}, "sidecar": {"name": name}})
    assert config_from_dict({"task": {"class": "a:B"}, "sidecar": {"name": "holdout-2.v1"}}).sidecar.name == "holdout-2.v1"


def test_a_huge_integer_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^--set trainer.seed=777777777777777777777777777: trainer.seed: expected "
                                          r"an integer from 0 to 2\*\*32 - 1, got 777777777777777777777777777$"):
        config_from_dict({"task": {"class": "a:B"}}, ["trainer.seed=777777777777777777777777777"])


def test_a_moved_key_inside_a_section_set_whole_names_its_new_place() -> None:
    data = {"task": {"class": "a:B"}}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, ["trainer={throttle_secs: 5, async_checkpoint: true}"])
    assert str(caught.value).splitlines() == [
        "--set trainer={throttle_secs: 5, async_checkpoint: true}: trainer.async_checkpoint: moved to checkpoint.async_save",
        "--set trainer={throttle_secs: 5, async_checkpoint: true}: trainer.throttle_secs: moved to eval_spec.throttle_secs",
    ]


# ------------------------------------------------------------------ one place for each rule and default


def test_the_schema_imports_no_yaml_and_no_overrides() -> None:
    """Components import their section (``SidecarConfig``) without the loading machinery."""
    code = ("import sys, cadence.config.schema as s; s.SidecarConfig(); "
            "print(sorted(m for m in sys.modules if m.startswith(('cadence.config', 'yaml'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["cadence.config", "cadence.config.base", "cadence.config.class_paths",
                               "cadence.config.components", "cadence.config.components.activation_checkpoint",
                               "cadence.config.components.compile",
                               "cadence.config.components.ema", "cadence.config.components.external_evaluators",
                               "cadence.config.components.fault_tolerance",
                               "cadence.config.components.lr_schedule",
                               "cadence.config.components.parallel", "cadence.config.components.profiler",
                               "cadence.config.components.slurm",
                               "cadence.config.intervals", "cadence.config.schema", "cadence.config.trainer"])


def test_the_package_still_exports_every_name() -> None:
    import cadence.config as config

    for name in config.__all__:
        assert getattr(config, name) is not None, name
    assert config.CallbackConfig is config.ClassSpec and issubclass(config.TaskConfig, config.ClassSpec)


def test_sidecar_defaults_live_in_its_section() -> None:
    from cadence.config import SidecarConfig

    s = SidecarConfig()
    assert (s.mode, s.timeout, s.poll_interval, s.max_pending, s.max_evaluations, s.lease_ttl, s.name) == (
        "every", 3600.0, 0.5, 8, None, 60.0, None)
    assert (s.max_retries, s.retry_backoff) == (3, 0.5)
    for bad in ({"max_retries": -1}, {"max_retries": 1.0}, {"retry_backoff": 0}):
        with pytest.raises(ConfigError, match=r"^config: sidecar\.(max_retries|retry_backoff): expected "):
            config_from_dict({"task": {"class": "a:B"}, "sidecar": bad})


def test_require_model_dir() -> None:
    cfg = config_from_dict({"task": {"class": "a:B"}})
    with pytest.raises(ConfigError, match=r"^model_dir: not set; give it in the config or with --model-dir$"):
        cfg.require_model_dir()
    assert config_from_dict({"task": {"class": "a:B"}}, model_dir="runs/x").require_model_dir() == "runs/x"


def test_export_formats_are_listed_once() -> None:
    from typing import get_args

    from cadence.config import EXPORT_FORMATS, ExportConfig, ExportFormat

    assert EXPORT_FORMATS == get_args(ExportFormat) == ("safetensors", "torch_export", "torchscript", "onnx", "hf")
    description = ExportConfig.model_fields["formats"].description or ""
    assert all(f"`{name}`" in description for name in EXPORT_FORMATS)


@pytest.mark.parametrize(("key", "empty"), [("trainer", {}), ("checkpoint", {}), ("eval_spec", {}), ("sidecar", {}),
                                            ("callbacks", [])])
def test_a_section_with_every_entry_commented_out_is_empty(tmp_path: Path, key: str, empty: object) -> None:
    cfg = load_config(write(tmp_path, f"task:\n  class: a:B\n  params:\n{key}:\n"))
    assert cfg.task.params == {}
    value = getattr(cfg, key)
    assert value == empty if isinstance(empty, list) else value == type(value)()


def test_null_stays_null_where_it_is_a_value() -> None:
    cfg = config_from_dict({"task": {"class": "a:B"}, "export": None, "trainer": {"best_checkpoint": None}})
    assert cfg.export is None and cfg.trainer.best_checkpoint is None
    with pytest.raises(ConfigError, match=r"export\.formats: expected a list of 'safetensors', .*, got null"):
        config_from_dict({"task": {"class": "a:B"}, "export": {"formats": None, "on": "final"}})


# ------------------------------------------------------------------ each component's settings: one model


def test_the_schema_holds_the_components_own_models() -> None:
    """The schema's sections for EMA, profiler, compile and LR schedule are the models the
    components take (cadence.config.components), not copies of their fields."""
    from cadence.config import components  # noqa: F401 - the package
    from cadence.config.components.compile import CompileConfig as Compile
    from cadence.config.components.ema import EMAConfig as EMA
    from cadence.config.components.lr_schedule import LRScheduleConfig as LRSchedule
    from cadence.config.components.profiler import ProfilerConfig as Profiler
    from cadence.config.schema import ExperimentConfig, TrainerConfig

    assert TrainerConfig.model_fields["ema"].annotation == EMA | None
    assert TrainerConfig.model_fields["compile"].annotation == Compile | None
    assert TrainerConfig.model_fields["lr_schedule"].annotation == LRSchedule | None
    assert ExperimentConfig.model_fields["profiler"].annotation == Profiler | None
    import cadence.config as config
    assert (config.EMAConfig, config.CompileConfig, config.LRScheduleConfig, config.ProfilerConfig) == (
        EMA, Compile, LRSchedule, Profiler)
    cfg = config_from_dict({"model_dir": "m", "task": {"class": "a:B"}, "profiler": {},
                            "trainer": {"train_steps": 5, "ema": {}, "compile": True,
                                        "lr_schedule": {"kind": "warmup_linear"}}})
    assert (type(cfg.trainer.ema), type(cfg.trainer.compile), type(cfg.trainer.lr_schedule), type(cfg.profiler)) == (
        EMA, Compile, LRSchedule, Profiler)
    assert (cfg.trainer.ema, cfg.trainer.compile, cfg.profiler) == (EMA(), Compile(), Profiler())


def test_the_profiler_defaults_are_the_sections_steps_13_to_15() -> None:
    """docs/changelog.md: one set of defaults, the YAML's (skip 10, wait 1, warmup 1, active 3, repeat 1),
    for `profiler: {}`, `--profile` and a ProfilerConfig built in code alike."""
    from cadence.config.components.profiler import ProfilerConfig

    window = ProfilerConfig()
    assert (window.skip_first, window.wait, window.warmup, window.active, window.repeat) == (10, 1, 1, 3, 1)
    assert not (window.record_shapes or window.profile_memory or window.with_stack or window.gzip)
    assert window.describe() == "steps 13-15"
    cycle = window.cycle(0)
    assert cycle is not None and (cycle.first_warmup, cycle.first_active, cycle.last_active) == (12, 13, 15)
    assert window.cycle(1) is None and window.next_start(1) == 12
    cfg = config_from_dict({"model_dir": "m", "task": {"class": "a:B"}, "profiler": {}})
    assert cfg.profiler == window
    assert config_from_dict({"model_dir": "m", "task": {"class": "a:B"}}).profiler is None  # off unless asked


def test_a_bound_reads_the_same_in_code_and_in_a_config_file() -> None:
    """One bound per field: built in code, the error names the field and its bound; in a config
    file, the schema's `expected ...` words."""
    from pydantic import ValidationError

    from cadence.config.components.ema import EMAConfig
    from cadence.config.components.lr_schedule import LRScheduleConfig
    from cadence.config.components.profiler import ProfilerConfig

    with pytest.raises(ValidationError, match=r"decay must be > 0 and < 1, got 1\.0"):
        EMAConfig(decay=1.0)
    with pytest.raises(ValidationError, match="repeat must be >= 0, got -1"):
        ProfilerConfig(repeat=-1)
    with pytest.raises(ValidationError, match=r"min_lr_ratio must be >= 0 and <= 1, got 1\.5"):
        LRScheduleConfig(kind="warmup_cosine", min_lr_ratio=1.5)
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"model_dir": "m", "task": {"class": "a:B"}, "trainer": {"ema": {"decay": 1.0}},
                          "profiler": {"repeat": -1}})
    assert str(caught.value).splitlines() == ["config: trainer.ema.decay: expected a number > 0 and < 1, got 1.0",
                                              "config: profiler.repeat: expected an integer >= 0, got -1"]
