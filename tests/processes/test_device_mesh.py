"""``trainer.parallel`` (a device mesh) on gloo CPU processes: tensor parallelism alone (2 ranks), HSDP
(dp_replicate 2 x dp_shard 2; dp_shard 2 x tp 2's data and shards: test_mesh_checkpoints.py); the
ranks of a TP group read the same batches, data-parallel ranks different ones; a TP run killed with
kill -9 resumes exactly;
degrees that do not fit the world are one line, exit 2, before the model dir is written."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from cli_run import checkpoint_weights, killed_after, run_cadence, same_weights
from configs import write_config

cadence = partial(run_cadence, env={"COLUMNS": "200"})
TASK = "tp_tasks.py:TPTask"


def train(config: Path, model_dir: Path, nproc: int, *sets: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    proc = cadence("train", str(config), "--model-dir", str(model_dir), "--nproc", str(nproc), "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def digests(directory: Path, nproc: int) -> list[list[str]]:
    """Every rank's training batches (a digest each), in rank order."""
    return [(directory / f"rank{r}").read_text().split() for r in range(nproc)]


def shards(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.iterdir() if p.name.endswith(".distcp"))


def test_hsdp_splits_the_data_over_all_four_data_parallel_ranks(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    config = write_config(tmp_path, TASK, params={"digest_dir": str(seen)},
                          trainer={"train_steps": 4, "parallel": {"dp_replicate": 2, "dp_shard": 2}})
    train(config, tmp_path / "run", 4)
    ranks = digests(seen, 4)
    assert all(len(r) == 4 for r in ranks)
    assert len({d for r in ranks for d in r}) == 16  # every rank its own batches
    assert len(shards(tmp_path / "run" / "checkpoints" / "ckpt-4")) == 4


def test_a_tp_run_killed_with_kill_9_resumes_bit_identical(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    config = write_config(tmp_path, TASK, params={"digest_dir": str(seen)},
                          trainer={"train_steps": 12, "checkpoint_interval": 4, "parallel": {"tp": 2}})
    train(config, tmp_path / "straight", 2)
    assert digests(seen, 2)[0] == digests(seen, 2)[1]
    killed_after(config, tmp_path / "run", 4, 12, "--nproc", "2")  # both ranks SIGKILLed after ckpt-4
    train(config, tmp_path / "run", 2)
    assert same_weights(checkpoint_weights(tmp_path / "run" / "checkpoints" / "ckpt-12"),
                        checkpoint_weights(tmp_path / "straight" / "checkpoints" / "ckpt-12"))


def test_degrees_that_do_not_fit_the_world_are_one_line_and_write_nothing(tmp_path):
    config = write_config(tmp_path, TASK, trainer={"parallel": {"dp_shard": 2, "tp": 2}})
    proc = cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # past the launcher's "starting 2 processes" line, the refusal alone, once for the job
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line or "Traceback" in line]
    assert lines == ["cadence: error: trainer.parallel (dp_replicate=1, dp_shard=2, tp=2): the degrees' product 4 "
                     "is not the world size 2 (processes)"], lines
    assert not (tmp_path / "run").exists()
