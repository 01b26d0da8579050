"""``trainer.compile: true`` with inductor on CUDA (Triton kernels generated, an eager resume of
its checkpoint), and the throughput summaries of a CUDA run: the peak memory of every loop and
the MFU against the device table (cadence.torch.components.device_peaks)."""

from __future__ import annotations

from pathlib import Path

import torch

from checks import CHARLM, TINY, check_throughput_records, final_checkpoint, train, write_config
from cli_run import checkpoint_weights
from tasks import TinyTask
from cadence.summaries.metrics_file import read_metrics
from cadence.torch.components.device_peaks import chip_of, peak_flops


def generated_triton_kernels(cache: Path) -> list[Path]:
    """The Python files inductor generated under its cache dir that define Triton kernels."""
    return [p for p in cache.rglob("*.py") if "@triton.jit" in p.read_text(errors="replace")]


def test_inductor_compiles_on_cuda_and_its_checkpoint_resumes_eagerly(tmp_path):
    check_compiled_run(tmp_path, "cuda", "inductor")


def check_compiled_run(tmp_path: Path, device: str, backend: str) -> None:
    """``trainer.compile`` with ``backend`` on ``device`` (``cuda`` with inductor: Triton kernels
    generated in a cold cache): a run of 20 steps, its checkpoint in the eager model's keys, then
    resumed eagerly to 30."""
    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}  # a cold cache: compiled in this run
    config = write_config(tmp_path, task=TINY, device=device, compile=True if backend == "inductor" else {"backend": backend})
    run = tmp_path / "run"
    proc = train(config, run, env=env)
    output = proc.stdout + proc.stderr
    assert f"compiling Sequential with torch.compile ({backend})" in output, output[-3000:]
    if device == "cuda" and backend == "inductor":
        assert generated_triton_kernels(cache), f"no Triton kernel under {cache}"
    weights = checkpoint_weights(final_checkpoint(run, 20))
    assert set(weights) == set(TinyTask().build_model().state_dict())  # no _orig_mod. prefix: eager keys
    assert all(torch.isfinite(t).all() for t in weights.values())
    losses = [r["loss"] for r in read_metrics(run / "train")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    resumed = train(config, run, "trainer.compile=false", "trainer.train_steps=30", env=env)
    assert "restored checkpoint" in resumed.stdout + resumed.stderr
    assert final_checkpoint(run, 30).is_dir()


def test_a_cuda_run_logs_each_loops_peak_memory_and_mfu_against_the_device_table(tmp_path):
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name, "bf16")
    assert (peak is None) == (chip_of(name) is None)  # a GPU in the table has a bf16 peak
    run = tmp_path / "charlm"
    proc = train(CHARLM, run, "trainer.device=cuda", "trainer.precision=bf16", "trainer.train_steps=40",
                 "trainer.steps_per_loop=10", "trainer.checkpoint_interval=40", "trainer.validation_interval=40",
                 "trainer.validation_steps=2")
    records = [r for r in read_metrics(run / "train") if "samples_per_second" in r]
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    check_throughput_records(records, cuda=True, peak=peak)
    assert all(r["tokens_per_second"] > 0 for r in records)  # charlm counts its tokens
    output = proc.stdout + proc.stderr
    if peak is None:  # a GPU the table does not know: said once, no MFU
        assert f"no MFU: the peak FLOP/s of {name!r} at precision bf16 is not known" in output
