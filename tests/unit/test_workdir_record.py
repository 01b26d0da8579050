"""``workdir``, the run's working directory (issue 40): recorded relative to a model dir's ``config.yaml``
inside it (absolute otherwise), resolved against the file's folder when read back (against the current
directory when set by ``--set``), and :func:`~cadence.config.workdir.in_workdir` running there."""

from __future__ import annotations

import logging
import os

import yaml

from cadence.config import config_from_dict, load_config, save_config
from cadence.config.workdir import in_workdir
from configs import config_data


def test_a_model_dir_inside_the_workdir_records_it_relative_and_reads_it_back_absolute(tmp_path):
    proj = tmp_path / "proj"
    path = proj / "runs" / "x" / "config.yaml"
    save_config(config_from_dict(config_data(), model_dir="runs/x"), path, workdir=str(proj))
    assert yaml.safe_load(path.read_text())["workdir"] == "../.."
    assert load_config(path).workdir == str(proj)
    moved = tmp_path / "moved"  # the project moved, model dirs and all: the record follows
    proj.rename(moved)
    assert load_config(moved / "runs" / "x" / "config.yaml").workdir == str(moved)


def test_a_model_dir_elsewhere_records_it_absolute(tmp_path):
    path = tmp_path / "elsewhere" / "config.yaml"
    (tmp_path / "proj").mkdir()
    save_config(config_from_dict(config_data(), model_dir=str(path.parent)), path, workdir=str(tmp_path / "proj"))
    assert yaml.safe_load(path.read_text())["workdir"] == str(tmp_path / "proj")


def test_a_config_without_one_records_none_and_an_override_is_relative_to_here(tmp_path, monkeypatch):
    path = tmp_path / "conf" / "config.yaml"
    save_config(config_from_dict(config_data()), path)
    assert yaml.safe_load(path.read_text())["workdir"] is None
    monkeypatch.chdir(tmp_path)
    assert load_config(path, overrides=["workdir=data"]).workdir == str(tmp_path / "data")
    assert load_config(path, overrides=["workdir=null"]).workdir is None
    assert load_config(path, overrides=["workdir=data"]) == load_config(path)  # the same experiment


def test_in_workdir_runs_there_with_the_model_dir_given_from_here(tmp_path, monkeypatch, caplog):
    (tmp_path / "proj").mkdir()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    cfg = config_from_dict({**config_data(), "workdir": str(tmp_path / "proj")}, model_dir="../proj/runs/x")
    with in_workdir(cfg) as run:
        assert os.getcwd() == str(tmp_path / "proj")
        assert run.model_dir == "runs/x" and run.workdir is None  # relative to where it runs
        with in_workdir(run) as again:  # nested: stays
            assert again is run and os.getcwd() == str(tmp_path / "proj")
    assert os.getcwd() == str(tmp_path / "here") and cfg.model_dir == "../proj/runs/x"
    gone = config_from_dict({**config_data(), "workdir": str(tmp_path / "gone")}, model_dir="runs/x")
    with caplog.at_level(logging.WARNING, logger="cadence"), in_workdir(gone) as run:
        assert run is gone and os.getcwd() == str(tmp_path / "here")
    assert f"workdir {tmp_path / 'gone'} (the directory the run was trained in) does not exist here" in caplog.text

