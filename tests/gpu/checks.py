"""The checks of the gpu tier, written against a device so that the paths with a CPU counterpart
can be checked on CPU too (that checks the test logic; only a run on CUDA covers the CUDA paths):
cadence runs as a user starts it (:func:`train`), exact resume (:func:`resumed_as_straight`), the
pinned staging of an asynchronous snapshot (:func:`check_snapshot_staging`), and the throughput
summaries (:func:`check_throughput_records`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from cli_run import checkpoint_weights, run_cadence, same_weights  # noqa: E402
from cuda_tasks import DETERMINISTIC_ENV  # noqa: E402

TINY = f"{TESTS / 'tasks.py'}:TinyTask"
DETERMINISTIC = f"{HERE / 'cuda_tasks.py'}:DeterministicTinyTask"
CHARLM = TESTS.parent / "examples" / "charlm" / "config.yaml"


def write_config(directory: Path, *, task: str = DETERMINISTIC, params: dict[str, Any] | None = None,
                 checkpoint: dict[str, Any] | None = None, **trainer: Any) -> Path:
    """A small run of ``task`` (20 steps, loops of 5, a checkpoint every 10) as ``config.yaml`` in
    ``directory``; ``trainer`` entries override."""
    cfg = {"task": {"class": task, "params": {"n": 256, **(params or {})}},
           "trainer": {"train_steps": 20, "steps_per_loop": 5, "checkpoint_interval": 10, "validation_interval": 10,
                       "max_to_keep": None, "seed": 1, "sanity_val_steps": 0, **trainer},
           "checkpoint": checkpoint or {}}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path, model_dir: Path, *sets: str, nproc: int | None = None, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """``cadence train CONFIG --model-dir MODEL_DIR --set ...`` (``--nproc N``) to completion, with
    :data:`DETERMINISTIC_ENV` and ``env`` (and log lines 200 columns wide, so that a message is on
    one line), asserted to exit 0; the process (its output for the caller's checks)."""
    args = ["train", str(config), "--model-dir", str(model_dir), "--no-progress"]
    args += [a for s in sets for a in ("--set", s)]
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    proc = run_cadence(*args, env={"COLUMNS": "200", **DETERMINISTIC_ENV, **(env or {})}, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def final_checkpoint(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"ckpt-{step}"


def resumed_as_straight(tmp_path: Path, config: Path, *sets: str, steps: int = 20, nproc: int | None = None) -> str:
    """Train ``config`` straight to ``steps`` in ``tmp_path/straight``; in ``tmp_path/resumed``
    train to ``steps // 2`` (a committed checkpoint, FINAL), then again to ``steps`` (a new
    process resumes it). Asserts the two final checkpoints hold bit-identical weights; returns
    the resuming run's output."""
    train(config, tmp_path / "straight", *sets, nproc=nproc)
    train(config, tmp_path / "resumed", *sets, f"trainer.train_steps={steps // 2}", nproc=nproc)
    assert final_checkpoint(tmp_path / "resumed", steps // 2).is_dir()
    proc = train(config, tmp_path / "resumed", *sets, nproc=nproc)
    output = proc.stdout + proc.stderr
    assert "restored checkpoint" in output, output[-3000:]
    straight = checkpoint_weights(final_checkpoint(tmp_path / "straight", steps))
    resumed = checkpoint_weights(final_checkpoint(tmp_path / "resumed", steps))
    assert same_weights(resumed, straight)
    return output


def optimizer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer, LR scheduler and grad-scaler state of a (not sharded) checkpoint."""
    from cadence.torch.checkpoint_io.tensor_tree import load_tree

    path = checkpoint / "optimizer.safetensors"
    return load_tree(path.read_bytes(), source=str(path))


def check_snapshot_staging(device: str) -> None:
    """A trainer's asynchronous snapshot on ``device`` (``cpu`` or ``cuda:N``): on CUDA its model and optimizer tensors
    are copied into pinned host memory without blocking (``ready`` is the event the writer waits
    for), on CPU into plain memory (nothing to wait for). Training goes on at once; what is
    written is the state at the snapshot, and the next snapshot reuses the written one's memory."""
    import safetensors.torch

    from cadence.checkpoint.files import MemoryWriter
    from cadence.torch import Context
    from cadence.torch.checkpoint_io.state import unwrap_model
    from cadence.torch import build_runners
    from cadence.torch.runtime.rng import seed_everything
    from tasks import TinyTask

    ctx = Context(device=torch.device(device), seed=0)
    cuda = ctx.device.type == "cuda"
    seed_everything(0)
    trainer, _ = build_runners(TinyTask(), ctx, evaluate=False)
    assert trainer is not None
    trainer.initialize()
    trainer.train(3)
    module = unwrap_model(trainer.model)
    assert all(p.device == ctx.device for p in module.parameters())

    def current() -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def moments(snapshot: Any) -> list[torch.Tensor]:
        return [t for state in snapshot.torch_state["optimizer"]["state"].values()
                for key, t in state.items() if key in ("exp_avg", "exp_avg_sq")]

    at_snapshot = current()
    first = trainer.snapshot_checkpoint()
    trainer.train(2)  # the device-to-host copies may still run: training changes the weights meanwhile
    assert (first.ready is not None) == cuda
    copies = [*first.model.tensors.values(), *moments(first)]
    assert len(moments(first)) == 2 * len(list(module.parameters()))
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in copies)
    assert all(t.is_pinned() == cuda for t in copies)
    writer = MemoryWriter(3)
    state = first.save_checkpoint(writer)
    assert state["global_step"] == 3 and first.written
    assert same_weights(safetensors.torch.load(writer.files["model.safetensors"]), at_snapshot)

    memory = {name: t.data_ptr() for name, t in first.model.tensors.items()}
    at_second = current()
    second = trainer.snapshot_checkpoint()  # into the written snapshot's buffers: no allocation
    if second.copied is not None:  # pipelined: the stager thread puts the copies in their slots
        second.copied.queued()
    assert {name: t.data_ptr() for name, t in second.model.tensors.items()} == memory
    assert all(t.is_pinned() == cuda for t in [*second.model.tensors.values(), *moments(second)])
    writer = MemoryWriter(5)
    assert second.save_checkpoint(writer)["global_step"] == 5
    assert same_weights(safetensors.torch.load(writer.files["model.safetensors"]), at_second)
    assert not same_weights(at_second, at_snapshot)


def check_throughput_records(records: list[dict[str, Any]], *, cuda: bool, peak: float | None) -> None:
    """Every train summary of a run logs its loop's rates; on CUDA the loop's peak memory
    (allocated at most reserved, both positive); with a known ``peak`` (FLOP/s) ``mfu`` in (0, 1],
    the achieved model FLOP/s over that peak; without one, no ``mfu``."""
    from cadence.summaries.throughput import MFU, MODEL_TFLOPS_PER_SECOND, PEAK_ALLOCATED_GIB, PEAK_RESERVED_GIB

    assert records
    for record in records:
        assert record["samples_per_second"] > 0
        if cuda:
            allocated, reserved = record[PEAK_ALLOCATED_GIB], record[PEAK_RESERVED_GIB]
            assert 0 < allocated <= reserved, record
        else:
            assert PEAK_ALLOCATED_GIB not in record and PEAK_RESERVED_GIB not in record
        if peak is None:
            assert MFU not in record
            continue
        assert 0 < record[MFU] <= 1, record
        assert record[MFU] == _approx(record[MODEL_TFLOPS_PER_SECOND] * 1e12 / peak), record


def _approx(value: float) -> Any:
    import pytest

    return pytest.approx(value, rel=1e-9)
