"""A model dir moved together with its code keeps working: the resolved ``MODEL_DIR/config.yaml``
records a ``file.py`` task class relative to itself when code and model dir lie inside the working
directory, and a moved model dir's own config never starts a new run at the old place."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from cli_run import run_cadence

from cadence.config.class_paths import portable_class_path

TESTS = Path(__file__).resolve().parents[1]


def test_train_move_both_and_resume_from_the_moved_config(tmp_path):
    project = tmp_path / "project"
    (project / "exp").mkdir(parents=True)
    shutil.copy(TESTS / "tasks.py", project / "exp" / "tasks.py")
    (project / "exp" / "config.yaml").write_text(
        "model_dir: runs/tiny\n"  # relative: against the working directory
        "task: {class: tasks.py:TinyTask}\n"  # relative: against this file
        "trainer: {train_steps: 10, steps_per_loop: 5, checkpoint_interval: 5, sanity_val_steps: 0}\n")
    first = run_cadence("train", "exp/config.yaml", "--no-progress", cwd=project)
    assert first.returncode == 0, first.stderr
    assert "no checkpoint restored" in first.stderr + first.stdout
    saved = yaml.safe_load((project / "runs" / "tiny" / "config.yaml").read_text())
    assert saved["task"]["class"] == "../../exp/tasks.py:TinyTask" and saved["model_dir"] == "runs/tiny"

    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(project), str(moved))
    model_dir = moved / "runs" / "tiny"
    # from the moved project: its own config.yaml resumes it at step 10
    again = run_cadence("train", "runs/tiny/config.yaml", "--set", "trainer.train_steps=15", "--no-progress",
                        cwd=moved)
    assert again.returncode == 0, again.stderr
    assert (model_dir / "checkpoints" / "ckpt-15").is_dir() and (model_dir / "checkpoints" / "ckpt-10").is_dir()
    assert not (project / "runs").exists()  # nothing written at the old place
    assert "no checkpoint restored" not in again.stderr + again.stdout
    # from anywhere: the same file without --model-dir is refused (it would start a new run in ./runs/tiny) ...
    refused = run_cadence("train", str(model_dir / "config.yaml"), "--set", "trainer.train_steps=20", cwd=tmp_path)
    assert refused.returncode == 2 and f"pass --model-dir {model_dir}" in refused.stderr, refused.stderr
    assert not (tmp_path / "runs").exists()
    # (--model-dir continues it); export reads the moved config from anywhere: the task file is found beside it
    exported = run_cadence("export", str(model_dir), "--checkpoint", "latest", "--format", "safetensors",
                           cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr


def test_code_or_model_dir_outside_the_working_directory_stays_absolute(tmp_path, monkeypatch):
    (tmp_path / "work" / "runs").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    inside, outside = str(tmp_path / "work" / "code" / "t.py"), str(tmp_path / "other" / "t.py")
    assert portable_class_path(f"{inside}:T", tmp_path / "work" / "runs" / "x") == "../../code/t.py:T"
    assert portable_class_path(f"{outside}:T", tmp_path / "work" / "runs" / "x") == f"{outside}:T"
    assert portable_class_path(f"{inside}:T", tmp_path / "elsewhere" / "x") == f"{inside}:T"
    assert portable_class_path("pkg.mod:T", tmp_path / "work" / "runs") == "pkg.mod:T"
