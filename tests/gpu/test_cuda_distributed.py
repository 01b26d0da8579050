"""NCCL with DDP and FSDP, and sharded checkpoints written on cadence's gloo checkpoint group.

NCCL gives each rank its own GPU: it refuses two ranks of a communicator on one device
("Duplicate GPU detected"), and cadence starts no process group for one process. So:

* on one GPU, a torchrun job of one rank (tests/gpu/nccl_worker.py) starts NCCL's group itself
  and wraps the model as cadence does on several ranks (DDP; FSDP2 over the task's units), trains
  with cadence's Controller, saves asynchronously (FSDP: every checkpoint sharded, written on the
  gloo checkpoint group from ``cadence.torch.parallel.sharding.checkpoint_group``) and resumes;
* on two GPUs or more, ``cadence train --nproc 2`` as a user runs it, with ``trainer.strategy``
  ``ddp`` and ``fsdp``.

Either way a run stopped halfway and resumed ends bit-identical to an uninterrupted one: the same
ranks, algorithms and collectives on the same GPUs give the same bits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checks import final_checkpoint, resumed_as_straight, write_config
from cli_run import ENV, checkpoint_weights, same_weights
from cuda_tasks import DETERMINISTIC_ENV

WORKER = Path(__file__).resolve().parent / "nccl_worker.py"
SHARDED_FILES = [".metadata", "MANIFEST.json", "__0_0.distcp", "state.json"]


def run_worker(strategy: str, model_dir: Path, steps: int, where: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(WORKER),
         strategy, str(model_dir), str(steps), where],
        capture_output=True, text=True, env={**ENV, **DETERMINISTIC_ENV}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((model_dir / "worker.json").read_text())


def check_one_rank_job(tmp_path: Path, strategy: str, where: str) -> None:
    """The one-rank job on ``where`` (``cuda``: NCCL; ``cpu``: gloo, a check of this test's logic):
    straight to step 20, and to 10 then resumed to 20, bit-identical; FSDP's checkpoints sharded."""
    backend = "nccl" if where == "cuda" else "gloo"
    straight = run_worker(strategy, tmp_path / "straight", 20, where)
    assert straight == {"backend": backend, "restored": None, "global_step": 20, "writes_shards": strategy == "fsdp"}
    first = run_worker(strategy, tmp_path / "resumed", 10, where)
    assert first["global_step"] == 10
    second = run_worker(strategy, tmp_path / "resumed", 20, where)
    assert (second["restored"], second["global_step"]) == (10, 20)
    for step in (10, 20):
        checkpoint = final_checkpoint(tmp_path / "resumed", step)
        files = sorted(p.name for p in checkpoint.iterdir())
        if strategy == "fsdp":
            assert files == SHARDED_FILES  # the rank's shards, through DCP on the gloo group
        else:
            assert "model.safetensors" in files and not any(f.endswith(".distcp") for f in files)
    assert same_weights(checkpoint_weights(final_checkpoint(tmp_path / "resumed", 20)),
                        checkpoint_weights(final_checkpoint(tmp_path / "straight", 20)))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_nccl_job_checkpoints_and_resumes_bit_identically(tmp_path, strategy):
    check_one_rank_job(tmp_path, strategy, "cuda")


def fewer_than_two_gpus() -> bool:
    """One GPU (without CUDA the folder's own skip, with its one reason, applies)."""
    return torch.cuda.is_available() and torch.cuda.device_count() < 2


@pytest.mark.skipif(fewer_than_two_gpus(), reason="needs 2 GPUs: NCCL refuses two ranks on one GPU (the one-GPU job covers it)")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cadence_train_on_two_gpus_over_nccl_resumes_bit_identically(tmp_path, strategy):
    check_two_rank_run(tmp_path, strategy, "cuda")


def check_two_rank_run(tmp_path: Path, strategy: str, device: str) -> None:
    """``cadence train --nproc 2`` on ``device`` (``cuda``: NCCL; ``cpu``: gloo, a check of this
    test's logic), saving asynchronously: resumed bit-identical; FSDP's checkpoints sharded."""
    probes = tmp_path / "probes"
    probes.mkdir()
    config = write_config(tmp_path, params={"probe_dir": str(probes)}, device=device, strategy=strategy,
                          checkpoint={"async_save": True})
    resumed_as_straight(tmp_path, config, nproc=2)
    backend = "nccl" if device == "cuda" else "gloo"
    assert {p.name: p.read_text() for p in probes.iterdir()} == {"rank0.backend": backend, "rank1.backend": backend}
    files = sorted(p.name for p in final_checkpoint(tmp_path / "resumed", 20).iterdir())
    if strategy == "fsdp":  # every rank wrote its shards, on the gloo checkpoint group, in the background
        assert files == [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp", "state.json"]
    else:
        assert "model.safetensors" in files
