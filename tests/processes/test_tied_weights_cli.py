"""Tied weights through the CLI (issue 27, item 1): the weight-tied GPT of tests/gpt_tasks.py trained with an
EMA and a safetensors export; a fresh interpreter loads the export and the checkpoint's files with a plain
``load_state_dict(load_file(...))`` and gets the logits of cadence's own evaluation path
(tests/tied_weights_check.py); ``cadence evaluate --checkpoint N`` evaluates it. The FSDP run is in
test_fsdp.py."""

from __future__ import annotations

import json

from cli_run import run_cadence
from tied_weights_check import check_tied_weights, gpt_config


def test_the_export_and_checkpoint_of_a_tied_gpt_load_with_a_plain_load_state_dict(tmp_path):
    config, run = gpt_config(tmp_path), tmp_path / "run"
    proc = run_cadence("train", str(config), "--model-dir", str(run), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = check_tied_weights(run)
    proc = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", str(step))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    in_process = {r["step"]: r for r in map(json.loads, (run / "eval" / "metrics.jsonl").read_text().splitlines())}
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["step"] == step and printed["loss"] == in_process[step]["loss"], (printed, in_process[step])
