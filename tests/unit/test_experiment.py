"""Building a run from a config (cadence.torch.experiments.experiment): actions and exports wired as
configured, and bad combinations refused before any training."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.summaries.metrics_file import read_metrics
from cadence.torch import load_exported, run_training

TASKS = Path(__file__).parents[1] / "tasks.py"


def config(tmp_path: Path, task: str = "TinyTask", **sections):
    trainer = {"train_steps": 30, "steps_per_loop": 5, "validation_interval": 10, "seed": 0,
               **sections.pop("trainer", {})}
    data = {"model_dir": str(tmp_path / "run"), "task": {"class": f"{TASKS}:{task}"}, "trainer": trainer, **sections}
    return config_from_dict(data)


def test_early_stopping_from_the_config_stops_the_run(tmp_path):
    # min_delta larger than any change: no evaluation improves on the first one
    cfg = config(tmp_path, trainer={"early_stopping": {"metric": "loss", "patience": 1, "min_delta": 100.0,
                                                       "higher_is_better": False}})
    run_training(cfg, progress=False)
    ckpts = tmp_path / "run" / "checkpoints"
    assert json.loads((ckpts / "FINAL").read_text())["step"] == 20
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "eval")] == [10, 20]


def test_eval_at_start_logs_the_baseline_that_early_stopping_does_not_count(tmp_path, caplog):
    # as above, with the evaluation of step 0 first: logged, but the patience starts at step 10
    stopping = {"metric": "loss", "patience": 1, "min_delta": 100.0, "higher_is_better": False}
    run_training(config(tmp_path, trainer={"early_stopping": stopping, "eval_at_start": True}), progress=False)
    assert json.loads((tmp_path / "run" / "checkpoints" / "FINAL").read_text())["step"] == 20
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "eval")] == [0, 10, 20]
    # training only (a sidecar evaluates): said, and ignored
    run_training(config(tmp_path / "alone", trainer={"eval_at_start": True, "train_steps": 5}), progress=False,
                 in_process_validation=False)
    assert "trainer.eval_at_start is ignored without in-process validation" in caplog.text
    assert not (tmp_path / "alone" / "run" / "eval").exists()


def test_export_on_final_and_every_eval(tmp_path):
    final = config(tmp_path, export={"formats": ["safetensors", "torchscript"], "on": "final"})
    run_training(final, progress=False)
    out = tmp_path / "run" / "export" / "final" / "30"
    scripted = load_exported(str(out), "torchscript")
    x = torch.randn(3, 8)
    assert scripted(x).shape == (3, 2)

    every = config(tmp_path / "b", export={"formats": ["safetensors"], "on": "every_eval", "max_to_keep": 1})
    run_training(every, progress=False)
    assert sorted(p.name for p in (tmp_path / "b" / "run" / "export" / "every_eval").iterdir()) == ["30"]


def test_exports_during_training_replace_and_delete_only_what_cadence_wrote(tmp_path, caplog):
    """Issue 39: a step directory of the user's under export/<name>/ is neither replaced by that step's
    export (skipped, a warning) nor deleted by retention (a warning); cadence's own older exports are."""
    every = tmp_path / "run" / "export" / "every_eval"
    (every / "10").mkdir(parents=True)
    (every / "10" / "README").write_text("mine")  # where step 10's export would go
    (every / "5").mkdir()
    (every / "5" / "notes.txt").write_text("mine too")  # an older "member": retention's to delete
    cfg = config(tmp_path, export={"formats": ["safetensors"], "on": "every_eval", "max_to_keep": 1})
    with caplog.at_level(logging.WARNING):
        run_training(cfg, progress=False)
    assert sorted(p.name for p in every.iterdir()) == ["10", "30", "5"]  # 20 deleted: cadence's
    assert os.listdir(every / "10") == ["README"] and (every / "10" / "README").read_text() == "mine"
    assert os.listdir(every / "5") == ["notes.txt"] and (every / "5" / "notes.txt").read_text() == "mine too"
    assert f"export skipped: export directory {every / '10'}: exists and is not a cadence export (holds README)" \
        in caplog.text
    assert f"not deleting old export {every / '5'}: it exists and is not a cadence export (holds notes.txt)" \
        in caplog.text
    assert load_exported(str(every / "30"), "safetensors")


def test_formats_needing_example_inputs_are_refused_before_training(tmp_path):
    cfg = config(tmp_path, task="NoExampleTask", export={"formats": ["onnx"], "on": "final"})
    with pytest.raises(ConfigError, match=r"\['onnx'\] need NoExampleTask.example_inputs\(\)"):
        run_training(cfg, progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/ckpt-*"))
    assert not (tmp_path / "run" / "train").exists()  # not a single step trained


def test_run_training_leaves_no_signal_handlers_behind(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    run_training(config(tmp_path), progress=False)
    assert {s: signal.getsignal(s) for s in before} == before
