"""The pieces every layer shares, each written once: the test of a local path against a URL
(:func:`cadence.storage.local_path`), an exception in one line (:func:`cadence.errors.one_line`) and
byte counts for people (:func:`cadence.units.format_size`); and the places that used to decide each
for themselves agree with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.config import config_from_dict, load_config, save_config
from cadence.config.class_paths import resolve_class_path
from cadence.errors import ConfigError, one_line
from cadence.storage import Storage, is_plain_path, is_url, local_path
from cadence.sweep.study import SweepDir, is_sweep_dir
from cadence.units import format_size


@pytest.mark.parametrize(("location", "local"), [
    ("runs/a", "runs/a"),
    ("/abs/runs/a", "/abs/runs/a"),
    ("file:///abs/runs/a", "/abs/runs/a"),
    ("local:///abs/runs/a", "/abs/runs/a"),
    ("file://runs/a", "runs/a"),
    ("memory://runs/a", None),
    ("s3://bucket/runs/a", None),
    ("gs://bucket/runs/a", None),
    ("simplecache::s3://bucket/runs/a", None),
])
def test_local_path_is_the_one_test_of_a_local_location(location, local):
    assert local_path(location) == local
    assert is_url(location) is (local is None)
    assert is_plain_path(location) is ("://" not in location)


@pytest.mark.parametrize("prefix", ["", "file://", "local://"])
def test_storage_and_local_path_agree_on_local_locations(tmp_path, prefix):
    storage = Storage(f"{prefix}{tmp_path}")
    assert storage.atomic_rename  # Storage opens it on the local disk ...
    assert local_path(f"{prefix}{tmp_path}") == str(tmp_path)  # ... and so does everyone else


@pytest.mark.parametrize("prefix", ["file://", "local://"])
def test_a_local_url_is_local_for_the_config_and_the_sweep(tmp_path, prefix):
    (tmp_path / "task.py").write_text("class T: pass\n")
    cfg = config_from_dict({"model_dir": str(tmp_path / "m"), "task": {"class": "task.py:T"}})
    target = tmp_path / "out" / "config.yaml"
    save_config(cfg, f"{prefix}{target}")
    loaded = load_config(f"{prefix}{target}")
    assert loaded.config_dir == target.parent  # a local config: relative class paths resolve beside it
    assert resolve_class_path("task.py:T", tmp_path) == f"{tmp_path / 'task.py'}:T"
    assert resolve_class_path(f"{prefix}{tmp_path}/task.py:T") == f"{prefix}{tmp_path}/task.py:T"  # not a path: as is
    (tmp_path / "sweep.json").write_text("{}")
    assert is_sweep_dir(f"{prefix}{tmp_path}") and is_sweep_dir(str(tmp_path))
    assert SweepDir.at(f"{prefix}{tmp_path / 'new'}").root == (tmp_path / "new").resolve()
    with pytest.raises(ConfigError, match="a sweep dir is local"):
        SweepDir.at("memory://sweep")


class _Boom(RuntimeError):
    pass


def test_one_line_names_the_type_and_the_first_line():
    assert one_line(_Boom("disk full\nsecond line")) == "_Boom: disk full"
    assert one_line(_Boom("\n  spaced   out \n")) == "_Boom: spaced out"
    assert one_line(_Boom("")) == one_line(_Boom("  \n ")) == "_Boom"
    assert one_line(ValueError("x" * 50), limit=10) == "ValueError: xxxxxxx..."
    assert one_line(ValueError("short"), limit=10) == "ValueError: short"
    assert one_line(ConfigError("config: a: expected 1\nconfig: b: expected 2"), all_lines=True) == (
        "ConfigError: config: a: expected 1 config: b: expected 2")


def test_format_size_is_the_units_module_s():
    assert [format_size(n) for n in (0, 512, 1023, 1024, 138.8 * 1024, 5 * 2**20, 1.2 * 2**30, 3 * 2**40)] == [
        "0 B", "512 B", "1023 B", "1.0 KiB", "138.8 KiB", "5.0 MiB", "1.2 GiB", "3072.0 GiB"]
    import cadence.summaries.progress as progress
    assert not hasattr(progress, "format_size")  # one home, not two


def test_the_units_module_imports_nothing_of_cadence():
    source = Path(__import__("cadence.units").units.__file__).read_text()
    assert "import cadence" not in source and "from cadence" not in source
