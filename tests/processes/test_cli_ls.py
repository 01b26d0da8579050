"""``cadence ls``: a table that fits the terminal (``COLUMNS``), the best checkpoint marked, ``--json``
and ``--verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.config import config_from_dict
from cadence.torch import run_training
from cli_run import run_cadence

TASKS = Path(__file__).parents[1] / "tasks.py"
EXTRA = ("precision_of_the_positive_class", "recall_of_the_positive_class", "f1_of_the_positive_class")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("ls") / "run"
    cfg = config_from_dict({
        "model_dir": str(model_dir), "task": {"class": f"{TASKS}:TinyTask"},
        "trainer": {"train_steps": 30, "steps_per_loop": 10, "checkpoint_interval": 10, "validation_interval": 10,
                    "max_to_keep": 2, "best_checkpoint": {"metric": "loss", "higher_is_better": False}},
    })
    run_training(cfg, progress=False)
    # more eval metrics, with long names, than 80 columns hold
    metrics = model_dir / "eval" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, **dict.fromkeys(EXTRA, 0.5)}) + "\n" for r in rows))
    return model_dir


def test_the_table_fits_80_columns_and_marks_the_best(model_dir):
    best = json.loads((model_dir / "best" / "best.json").read_text())["step"]
    proc = run_cadence("ls", str(model_dir), env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"checkpoints in {model_dir / 'checkpoints'}"
    header = lines[1].split()
    assert header[:4] == ["step", "committed", "size", "loss"]  # the best checkpoint's metric first
    table = lines[1:5]  # header, rule, ckpt-20, ckpt-30 (max_to_keep: 2)
    assert all(len(line) <= 80 for line in table), "\n" + "\n".join(table)
    rows = {line.split()[0]: line for line in table[2:]}
    assert sorted(rows) == ["20", "30"] and rows["30"].endswith("final, latest")
    if str(best) in rows:
        assert "best" in rows[str(best)]
    assert f"best: step {best} (loss=" in proc.stdout and str(model_dir / "best" / f"ckpt-{best}") in proc.stdout
    left_out = [line for line in lines if line.startswith("(not shown in 80 columns:")]
    assert len(left_out) == 1 and all(m in left_out[0] for m in EXTRA if m not in header)
    wide = run_cadence("ls", str(model_dir), env={"COLUMNS": "250"})
    assert all(m in wide.stdout.splitlines()[1] for m in EXTRA) and "not shown" not in wide.stdout


def test_json_with_verify(model_dir):
    proc = run_cadence("ls", str(model_dir), "--json", "--verify")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert listing["best"]["step"] == best["step"] and listing["best"]["metric"] == "loss"
    assert (listing["latest_step"], listing["final_step"], listing["corrupt"]) == (30, 30, 0)
    rows = listing["checkpoints"]
    assert [r["step"] for r in rows] == [20, 30]
    assert all(r["verified"] is True and r["corrupt"] is None and r["size"] > 0 for r in rows)
    assert [r["best"] for r in rows] == [r["step"] == best["step"] for r in rows]
    assert rows[-1]["final"] and rows[-1]["latest"] and not rows[0]["final"]
    assert set(rows[0]["metrics"]) == {"loss", "accuracy", *EXTRA}


def test_a_corrupt_checkpoint_in_json_and_table(model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    weights = copy / "checkpoints" / "ckpt-20" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    unverified = run_cadence("ls", str(copy), "--json")  # the files are not read: nothing is marked
    assert unverified.returncode == 0 and json.loads(unverified.stdout)["corrupt"] == 0
    listing = run_cadence("ls", str(copy), "--json", "--verify")
    assert listing.returncode == 1
    rows = {r["step"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert rows[20]["verified"] is False and "model.safetensors" in rows[20]["corrupt"]
    assert rows[30]["verified"] is True
    table = run_cadence("ls", str(copy), "--verify", env={"COLUMNS": "80"})
    assert table.returncode == 1 and "step 20: CORRUPT: " in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines()[1:5])


def test_the_exit_status_is_1_exactly_when_a_checkpoint_is_marked_corrupt(model_dir, tmp_path):
    """With or without --verify: an unreadable manifest is marked (and exits 1) either way; the
    help says so."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    (copy / "checkpoints" / "ckpt-20" / "MANIFEST.json").write_text("{not json")
    for flags in ([], ["--verify"]):
        proc = run_cadence("ls", str(copy), *flags, env={"COLUMNS": "120"})
        assert proc.returncode == 1 and "step 20: CORRUPT: " in proc.stdout, (flags, proc.stdout + proc.stderr)
    helped = run_cadence("ls", "--help", env={"COLUMNS": "200"})
    assert "exit status is 1 when a checkpoint is marked CORRUPT" in " ".join(helped.stdout.split())
