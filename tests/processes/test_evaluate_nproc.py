"""``cadence evaluate --nproc N``: the evaluation of a checkpoint on N processes, one JSON line
(the chief's), metrics equal to a single process's."""

from __future__ import annotations

import json

import pytest

from cli_run import run_cadence
from configs import write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate-nproc")
    config = write_config(tmp, params={"n": 256}, trainer={"train_steps": 8, "validation_interval": 4,
                                                           "best_checkpoint": {"metric": "loss", "higher_is_better": False}})
    proc = run_cadence("train", str(config), "--model-dir", str(tmp / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return config, tmp / "run"


def test_two_processes_print_one_json_line_with_the_single_process_metrics(trained):
    config, run = trained
    one = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "8")
    two = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "8", "--nproc", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert len(two.stdout.strip().splitlines()) == 1  # the chief's line only, without a rank prefix
    single, double = json.loads(one.stdout), json.loads(two.stdout)
    assert double["step"] == single["step"] == 8
    assert double == pytest.approx(single, rel=1e-6)  # exact reducers over uneven shards
    assert not [line for line in two.stderr.splitlines() if line.startswith("[rank1]") and "INFO" in line]


def test_the_ranks_evaluate_the_best_checkpoint(trained):
    """``--checkpoint best`` is passed on to the ranks, which read ``best/`` (issue 40)."""
    config, run = trained
    step = json.loads((run / "best" / "best.json").read_text())["step"]
    one = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", str(step))
    two = run_cadence("evaluate", str(config), "--model-dir", str(run), "--checkpoint", "best", "--nproc", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert json.loads(two.stdout)["step"] == step
    assert json.loads(two.stdout) == pytest.approx(json.loads(one.stdout), rel=1e-6)


@pytest.mark.parametrize("args, message", [
    (("--checkpoint", "best", "--continuous"), "--checkpoint and --continuous exclude each other"),
    (("--nproc", "2", "--max-restarts", "1"), "--max-restarts: only for a sidecar of several ranks (--continuous --nproc N)"),
    (("--nproc", "0"), "--nproc: must be >= 1, got 0"),
])
def test_bad_nproc_is_a_one_line_error(trained, args, message):
    config, run = trained
    proc = run_cadence("evaluate", str(config), "--model-dir", str(run), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
