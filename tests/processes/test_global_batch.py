"""A global batch size (``ctx.per_rank_batch``): ``--nproc N`` trains on the same samples per step
as one process, and a batch that does not divide by the world size is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_run import run_cadence
from safetensors.torch import load_file

from cadence.errors import ConfigError
from cadence.torch import Context
from cadence.torch.experiments.task_loader import load_task_class

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"


def test_per_rank_batch_divides_or_says_what_to_use():
    assert Context().per_rank_batch(64) == 64
    assert Context(rank=1, world_size=2).per_rank_batch(64) == 32
    assert Context(rank=3, world_size=4).per_rank_batch(64) == 16
    with pytest.raises(ConfigError, match=r"^task.params.global_batch_size: 64 does not divide by the world size 3 "
                                          r"\(processes\): use a multiple of 3, e.g. 63 or 66$"):
        Context(rank=0, world_size=3).per_rank_batch(64, name="task.params.global_batch_size")
    with pytest.raises(ConfigError, match="e.g. 4$"):
        Context(rank=0, world_size=4).per_rank_batch(2)
    for bad in (0, -8, 8.0, True):
        with pytest.raises(ConfigError, match="expected an integer >= 1"):
            Context().per_rank_batch(bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def digits_task():
    return load_task_class(f"{DIGITS / 'task.py'}:DigitsTask")(global_batch_size=64)


def _rows(batch) -> list[tuple[float, ...]]:
    x, y = batch
    return sorted(tuple(row.tolist()) + (int(label),) for row, label in zip(x, y))


def test_the_digits_example_sees_the_same_global_batches_on_two_ranks(digits_task):
    # 30 steps: past the end of the first epoch (22 whole batches of 64 in 1438 samples)
    steps = 30
    one = iter(digits_task.build_inputs("train", Context(seed=0)))
    ranks = [iter(digits_task.build_inputs("train", Context(rank=r, world_size=2, seed=0))) for r in range(2)]
    for step in range(steps):
        single = next(one)
        parts = [next(it) for it in ranks]
        assert [len(p[0]) for p in parts] == [32, 32] and len(single[0]) == 64, step
        both = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        assert _rows(both) == _rows(single), f"step {step + 1}: the two ranks' batches are not the global batch"


def test_a_global_batch_that_does_not_divide_is_exit_2_with_one_line(tmp_path):
    proc = run_cadence("train", str(DIGITS / "config.yaml"), "--model-dir", str(tmp_path / "run"),
                       "--set", "task.params.global_batch_size=0", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "cadence: error: task.params.global_batch_size: expected an integer >= 1, got 0")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # found before the model dir is written


def test_two_processes_train_the_same_run_as_one(tmp_path):
    # no dropout: then only the order of float sums differs between the two runs
    sets = ["--set", "trainer.train_steps=30", "--set", "trainer.steps_per_loop=15", "--set", "export=null",
            "--set", "trainer.best_checkpoint=null", "--set", "trainer.validation_interval=null",
            "--set", "trainer.sanity_val_steps=0", "--set", "task.params.dropout=0.0"]
    runs = {}
    # "doubled": what --nproc 2 trained before, with a per-rank batch of 64 (a global batch of 128).
    # "accum": 2 ranks of 16 samples, 2 micro-batches each (grad_accum_steps is per rank, not divided by
    # the world size as nanoGPT's is): 16 x 2 x 2 = the 64 samples of each step of "one"
    accum = ["--nproc", "2", "--set", "task.params.global_batch_size=32", "--set", "trainer.grad_accum_steps=2"]
    for name, extra in (("one", []), ("two", ["--nproc", "2"]), ("doubled", ["--set", "task.params.global_batch_size=128"]),
                        ("accum", accum)):
        model_dir = tmp_path / name
        proc = run_cadence("train", str(DIGITS / "config.yaml"), "--model-dir", str(model_dir), "--no-progress",
                           *sets, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = load_file(model_dir / "checkpoints" / "ckpt-30" / "model.safetensors")
    one, two, doubled = runs["one"], runs["two"], runs["doubled"]
    assert one.keys() == two.keys() == runs["accum"].keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(runs["accum"][key], one[key], rtol=1e-4, atol=1e-5)
    assert max(float((doubled[k] - one[k]).abs().max()) for k in one) > 1e-2  # the tolerance tells them apart
