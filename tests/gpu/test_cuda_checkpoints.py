"""CUDA checkpoints: an asynchronous save stages the state in pinned host memory, and a CUDA run
saved asynchronously resumes bit-identically in 32-bit, bf16 and fp16 (whose grad scaler is in
every checkpoint and continues on resume).

Exact on CUDA: the task turns torch's deterministic algorithms on (cuBLAS with a fixed workspace),
and the weights compared are the final checkpoint's ``model.safetensors``, every bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checks import (
    check_snapshot_staging,
    check_throughput_records,
    final_checkpoint,
    optimizer_state,
    resumed_as_straight,
    write_config,
)
from cli_run import checkpoint_weights
from cadence.summaries.metrics_file import read_metrics
from cadence.torch.components.device_peaks import peak_flops
from cadence.torch.components.precision import resolve_precision
from cadence.torch.components.throughput import float32_matmuls_use_tf32


def test_an_asynchronous_snapshot_stages_cuda_tensors_in_pinned_memory():
    check_snapshot_staging("cuda:0")  # the device the parameters report


def test_bf16_and_fp16_resolve_on_cuda_to_autocast_and_fp16_to_a_grad_scaler():
    layer = torch.nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda")
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        precision = resolve_precision(name, "cuda")
        with precision.autocast():
            assert layer(x).dtype == dtype
        scaler = precision.make_grad_scaler()
        assert (scaler is not None) == (name == "fp16")
    assert resolve_precision("32", "cuda").make_grad_scaler() is None


class Runs:
    """The runs of one precision, made once per module: ``straight`` (20 steps) and ``resumed``
    (10, then resumed to 20), with asynchronous saves; ``output``: the resuming process's."""

    def __init__(self, root: Path, precision: str, device: str = "cuda") -> None:
        self.root = root
        config = write_config(root, device=device, precision=precision, checkpoint={"async_save": True})
        self.output = resumed_as_straight(root, config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    made: dict[str, Runs] = {}

    def of(precision: str) -> Runs:
        if precision not in made:
            made[precision] = Runs(tmp_path_factory.mktemp(f"precision-{precision}"), precision)
        return made[precision]

    return of


@pytest.mark.parametrize("precision", ["32", "bf16", "fp16"])
def test_a_cuda_run_saved_asynchronously_resumes_bit_identically(runs, precision):
    run = runs(precision)  # asserts the resumed run's final weights are the straight run's
    weights = checkpoint_weights(final_checkpoint(run.root / "resumed", 20))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())  # autocast keeps float32 weights
    peak = peak_flops(torch.cuda.get_device_name(0), precision, tf32=float32_matmuls_use_tf32())
    for model_dir in ("straight", "resumed"):
        check_throughput_records(read_metrics(run.root / model_dir / "train"), cuda=True, peak=peak)


def test_fp16_checkpoints_hold_the_grad_scaler_and_a_resumed_run_continues_it(runs):
    check_grad_scaler_continues(runs("fp16"))


def check_grad_scaler_continues(run: Runs) -> None:
    """The fp16 runs' checkpoints hold the grad scaler's state, and the resumed run's is the
    straight run's."""
    assert "starts afresh" not in run.output  # the warning of a resume without the scaler's state
    halfway = optimizer_state(final_checkpoint(run.root / "resumed", 10))["grad_scaler"]
    assert halfway is not None and halfway["scale"] > 0
    assert halfway == optimizer_state(final_checkpoint(run.root / "straight", 10))["grad_scaler"]
    straight = optimizer_state(final_checkpoint(run.root / "straight", 20))["grad_scaler"]
    resumed = optimizer_state(final_checkpoint(run.root / "resumed", 20))["grad_scaler"]
    assert straight != halfway  # 10 steps move it: the growth tracker counts them, a skipped step halves the scale
    assert resumed == straight  # scale and growth tracker: as if never stopped (a fresh scaler would count from 0)
