"""Throughput in the train summaries: samples/s and tokens/s from the loop's own timing, FLOPs per
sample (the task's, or counted once on the meta device) and MFU against a peak, peak CUDA memory,
the GPU peak table, the progress line and ``cadence report``. Speed is measured in
``benchmarks/loop/throughput_overhead.py``, never here."""

from __future__ import annotations

import io
import logging
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_run import run_cadence
from rich.console import Console
from torch import nn
from torch.nn import functional as F

from cadence import Controller
from cadence.summaries import progress
from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.summaries.progress import ProgressReporter
from cadence.summaries.metrics_file import read_metrics
from cadence.summaries.throughput import LoopWork, format_throughput, throughput_logs
from cadence.torch import Context, Task, build_runners, run_training
from cadence.torch.components.device_peaks import PEAK_TFLOPS, chip_of, peak_flops
from cadence.torch.runtime.rng import seed_everything
from cadence.torch.components.throughput import count_flops_per_sample

TASKS = Path(__file__).parents[1] / "tasks.py"
ROOT = Path(__file__).resolve().parents[2]  # holds the package `benchmarks`
BATCH, SEQ, VOCAB = 4, 7, 13


class TokenTask(Task):
    """A next-token model on (BATCH, SEQ) token ids; counts tokens from the batch's shape."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_inputs(self, split, ctx):
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(40)]

    def train_step(self, model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def validation_step(self, model, batch):
        return {}

    def tokens_per_batch(self, batch):
        return batch.numel()


class NoisyTask(Task):
    """An MLP with batch norm and dropout whose build_model and train_step draw from Python's and
    NumPy's RNGs and keep the model on the task: what a FLOPs count must leave as it was."""

    def __init__(self, widths=(6, 10, 12, 3), flops: float | None = None, item: bool = False) -> None:
        super().__init__()
        self.widths, self.flops, self.item = widths, flops, item
        self.model: nn.Module | None = None

    def build_model(self) -> nn.Module:
        random.random()
        np.random.rand()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(self.widths, self.widths[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(self.widths) - 2:
                layers += [nn.BatchNorm1d(b), nn.ReLU(), nn.Dropout(0.3)]
        self.model = nn.Sequential(*layers)
        return self.model

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def build_inputs(self, split, ctx):
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(5, self.widths[0], generator=g), torch.randint(0, self.widths[-1], (5,), generator=g))
                for _ in range(30)]

    def train_step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y) * (1 + 0.1 * random.random() + 0.1 * float(np.random.rand()))
        if self.item:
            loss = loss * (1 + 0 * loss.item())  # needs a real value: cannot be counted on the meta device
        return loss

    def validation_step(self, model, batch):
        return {}

    def flops_per_sample(self):
        return self.flops


def train(task: Task, steps: int, *, model_dir: Path | None = None, steps_per_loop: int = 4,
          **runner_kwargs) -> tuple[nn.Module, list[dict]]:
    """Train ``task`` for ``steps`` in one process; the trained model and the loops' logs."""
    seed_everything(0)
    trainer, _ = build_runners(task, Context(), evaluate=False, **runner_kwargs)
    seen: list[dict] = []
    summary_dir = str(model_dir / "train") if model_dir is not None else None
    with Controller(trainer=trainer, steps_per_loop=steps_per_loop, summary_dir=summary_dir, progress=False,
                    train_actions=[seen.append]) as controller:
        controller.train(steps, checkpoint_at_completion=False)
    return trainer.model, seen


def mlp_flops_per_sample(widths) -> int:
    """Forward 2*a*b per linear layer; backward 2*a*b for the weight's gradient and 2*a*b for the
    input's, except the first layer's input (it needs no gradient)."""
    pairs = list(zip(widths, widths[1:]))
    return sum(2 * a * b * (2 if i == 0 else 3) for i, (a, b) in enumerate(pairs))


# -- samples/s and tokens/s of real runs -----------------------------------------------------------


def test_samples_and_tokens_per_second_are_logged_over_the_loops_time(tmp_path):
    _, logs = train(TokenTask(), 12, model_dir=tmp_path)
    records = read_metrics(tmp_path / "train")
    assert [r["step"] for r in records] == [4, 8, 12] and len(logs) == 3
    for record in (*records, *logs):
        sps = record["steps_per_second"]
        assert record["samples_per_second"] == pytest.approx(sps * BATCH, rel=1e-12)
        assert record["tokens_per_second"] == pytest.approx(sps * BATCH * SEQ, rel=1e-12)
        assert "mfu" not in record and "model_tflops_per_second" not in record  # CPU, no peak given
        assert not any(key.startswith("memory/") for key in record)  # CUDA only


def test_accumulated_micro_batches_are_all_counted_and_no_tokens_without_the_hook(tmp_path):
    task = NoisyTask()
    _, logs = train(task, 6, steps_per_loop=3, grad_accum_steps=2)
    for record in logs:
        assert record["samples_per_second"] == pytest.approx(record["steps_per_second"] * 2 * 5, rel=1e-12)
        assert "tokens_per_second" not in record


def test_log_throughput_false_counts_nothing():
    class Uncountable(TokenTask):  # any count fails
        def batch_size_of(self, batch):
            raise AssertionError("batch_size_of called")

        def tokens_per_batch(self, batch):
            raise AssertionError("tokens_per_batch called")

        def flops_per_sample(self):
            raise AssertionError("flops_per_sample called")

    _, logs = train(Uncountable(), 8, peak_tflops=1.0, log_throughput=False)
    assert len(logs) == 2 and all(set(r) == {"loss", "learning_rate", "steps_per_second"} for r in logs)
    cfg = config_from_dict({"task": {"class": f"{TASKS}:TinyTask"}, "trainer": {"log_throughput": False}})
    assert cfg.trainer.log_throughput is False
    with pytest.raises(ConfigError, match=r"trainer.log_throughput: expected true or false"):
        config_from_dict({"task": {"class": f"{TASKS}:TinyTask"}, "trainer": {"log_throughput": "no"}})


def test_two_ranks_log_the_global_samples(tmp_path):
    """``--nproc 2``: each rank counts its own batches (8 samples); the summary is the global rate."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"class": f"{TASKS}:TinyTask", "params": {"n": 64}},
        "trainer": {"train_steps": 8, "steps_per_loop": 4, "checkpoint_interval": None, "sanity_val_steps": 0,
                    "in_process_validation": False, "peak_tflops": 1e-6}}))
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = read_metrics(tmp_path / "run" / "train")
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        assert r["samples_per_second"] == pytest.approx(r["steps_per_second"] * 2 * 8, rel=1e-12)
        # per device: this rank's 8 samples per step, 704 FLOPs each (an 8-16-2 MLP)
        assert r["model_tflops_per_second"] * 1e12 == pytest.approx(r["steps_per_second"] * 8 * 704, rel=1e-9)


def test_batches_without_a_tensor_warn_once_and_train_on(caplog):
    class Words(TokenTask):
        def build_inputs(self, split, ctx):
            return [["a b c", "d e"]] * 10

        def train_step(self, model, batch):
            return model(torch.zeros(len(batch), 2, dtype=torch.long)).sum()

        def tokens_per_batch(self, batch):
            return sum(len(s.split()) for s in batch)

    with caplog.at_level(logging.WARNING, logger="cadence"):
        _, logs = train(Words(), 8)
    assert [r for r in caplog.records if "no samples/s" in r.getMessage()] == [caplog.records[0]]
    assert "Words.batch_size_of: no tensor found" in caplog.records[0].getMessage()
    for record in logs:
        assert "samples_per_second" not in record
        assert record["tokens_per_second"] == pytest.approx(record["steps_per_second"] * 5, rel=1e-12)


# -- FLOPs and MFU ---------------------------------------------------------------------------------


def test_flops_counted_for_an_mlp_equal_the_analytic_count():
    widths = (6, 10, 12, 3)
    task = NoisyTask(widths)
    batch = task.build_inputs("train", Context())[0]
    kept = task.model = nn.Linear(1, 1)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert count_flops_per_sample(task, batch) == mlp_flops_per_sample(widths)  # 2*6*10*2 + 3*(2*10*12 + 2*12*3)
    assert task.model is kept  # build_model's assignment undone
    assert random.getstate() == rng[0] and np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2])


def test_mfu_with_peak_tflops_on_cpu_is_the_counted_flops_over_the_peak(tmp_path, capsys):
    cfg = config_from_dict({
        "model_dir": str(tmp_path / "run"), "task": {"class": f"{TASKS}:TinyTask"},
        "trainer": {"train_steps": 12, "steps_per_loop": 4, "checkpoint_interval": None, "peak_tflops": 2e-6}})
    run_training(cfg, progress=True)
    records = read_metrics(tmp_path / "run" / "train")
    assert len(records) == 3
    for r in records:  # TinyTask: an 8-16-2 MLP, batch 8: 4*8*16 + 6*16*2 = 704 FLOPs per sample
        achieved = r["steps_per_second"] * 8 * 704
        assert r["model_tflops_per_second"] * 1e12 == pytest.approx(achieved, rel=1e-9)
        assert r["mfu"] == pytest.approx(achieved / 2e6, rel=1e-9)
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    mfu = records[-1]["mfu"]
    assert f"MFU {mfu * 100:.3g}%" in last_line and " samples/s  " in last_line
    assert "samples_per_second=" not in last_line and "mfu=" not in last_line and "loss=" in last_line


def test_counting_flops_leaves_the_run_bit_identical():
    """A run that counts FLOPs after its first loop (a peak is set) ends with the weights, batch-norm
    statistics and RNG states of one that does not, and the task still holds its model."""
    counted_task, plain_task = NoisyTask(), NoisyTask()
    counted, counted_logs = train(counted_task, 12, peak_tflops=1.0)
    counted_rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    plain, plain_logs = train(plain_task, 12)
    plain_rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert all("mfu" in r for r in counted_logs) and not any("mfu" in r for r in plain_logs)
    assert counted_logs[0]["model_tflops_per_second"] * 1e12 == pytest.approx(
        counted_logs[0]["samples_per_second"] * mlp_flops_per_sample(counted_task.widths), rel=1e-9)
    a, b = counted.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # incl. running_mean / _var
    assert counted_rng[0] == plain_rng[0] and np.array_equal(counted_rng[1], plain_rng[1])
    assert torch.equal(counted_rng[2], plain_rng[2])
    assert counted_task.model is counted  # the task's own model, not the meta copy


def _warnings(caplog) -> list[logging.LogRecord]:
    """The warnings and errors captured (an earlier test may have left the cadence logger at INFO)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_tasks_flops_per_sample_are_used_and_a_bad_one_is_one_warning(caplog):
    _, logs = train(NoisyTask(flops=1e6), 8)  # no peak: TFLOP/s, but no MFU
    for r in logs:
        assert r["model_tflops_per_second"] == pytest.approx(r["samples_per_second"] * 1e6 / 1e12, rel=1e-12)
        assert "mfu" not in r
    with caplog.at_level(logging.WARNING, logger="cadence"):
        _, logs = train(NoisyTask(flops=-3.0), 12, peak_tflops=1.0)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "NoisyTask.flops_per_sample() returned -3.0" in warned[0].getMessage()
    assert not any("mfu" in r for r in logs)


def test_a_step_that_cannot_run_on_the_meta_device_is_one_warning_and_no_mfu(caplog):
    with caplog.at_level(logging.WARNING, logger="cadence"):
        _, logs = train(NoisyTask(item=True), 12, peak_tflops=1.0)
    warned = _warnings(caplog)
    assert len(warned) == 1
    message = warned[0].getMessage()
    assert message.startswith("no MFU: counting the FLOPs of NoisyTask's train_step on the meta device failed")
    assert "Task.flops_per_sample()" in message
    assert len(logs) == 3 and all("samples_per_second" in r and "mfu" not in r for r in logs)


def test_peak_tflops_in_the_config_is_checked():
    for bad in (0, -1.0, float("nan"), "fast", True):
        with pytest.raises(ConfigError, match=r"trainer.peak_tflops: expected a number > 0 or null"):
            config_from_dict({"task": {"class": f"{TASKS}:TinyTask"}, "trainer": {"peak_tflops": bad}})
    cfg = config_from_dict({"task": {"class": f"{TASKS}:TinyTask"}, "trainer": {"peak_tflops": 312}})
    assert cfg.trainer.peak_tflops == 312.0


# -- the rates and the GPU table (pure) ------------------------------------------------------------


def test_throughput_logs():
    work = LoopWork(samples=100, tokens=800, world_size=2, flops_per_sample=1e9, peak_flops=1e12)
    assert throughput_logs(work, 0.5) == {"samples_per_second": 400.0, "tokens_per_second": 3200.0,
                                          "model_tflops_per_second": 0.2, "mfu": 0.2}  # per device: 100 samples
    assert throughput_logs(LoopWork(samples=10), 2.0) == {"samples_per_second": 5.0}
    assert throughput_logs(LoopWork(samples=10, peak_flops=1e12), 2.0) == {"samples_per_second": 5.0}
    assert throughput_logs(LoopWork(tokens=6, flops_per_sample=1.0), 2.0) == {"tokens_per_second": 3.0}
    assert throughput_logs(work, 0.0) == {}


@pytest.mark.parametrize("name, chip", [
    ("NVIDIA H100 80GB HBM3", "h100 sxm"), ("NVIDIA H100 PCIe", "h100 pcie"), ("NVIDIA H100 NVL", "h100 nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200 nvl"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100"), ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"), ("NVIDIA L40", "l40"), ("NVIDIA L40S", "l40s"),
    ("Tesla V100-SXM2-16GB", "v100 sxm"), ("Tesla V100-PCIE-32GB", "v100 pcie"), ("Tesla V100S-PCIE-32GB", "v100s pcie"),
    ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 3090", "rtx 3090"), ("NVIDIA GeForce RTX 4090", "rtx 4090"),
    ("NVIDIA GeForce RTX 3090 Ti", None), ("AMD Instinct MI300X", None), ("NVIDIA B200", None),
])
def test_device_names_map_to_their_chip(name, chip):
    assert chip_of(name) == chip
    assert chip is None or chip in PEAK_TFLOPS


def test_peak_by_precision():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "fp16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "32") == 19.5e12  # float32 matmuls in full precision
    assert peak_flops("NVIDIA A100-SXM4-40GB", "32", tf32=True) == 156e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("Tesla T4", "fp16") == 65e12
    assert peak_flops("Tesla T4", "32", tf32=True) == 8.1e12  # no TF32 on Turing: the float32 rate
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("AMD Instinct MI300X", "bf16") is None
    for peaks in PEAK_TFLOPS.values():  # dense tensor-core rates above the plain float32 one
        assert all(math.isfinite(v) and v >= peaks["fp32"] for v in peaks.values())


# -- what people see -------------------------------------------------------------------------------


def test_the_progress_line_shows_the_throughput_in_its_units(monkeypatch):
    monkeypatch.setattr(progress, "_monotonic", lambda: 1000.0)
    buf = io.StringIO()
    with ProgressReporter(600, console=Console(file=buf, force_terminal=False, width=200), log_interval_s=0) as p:
        p.update(200, {"loss": 0.25, "samples_per_second": 1234.5, "tokens_per_second": 45678.0,
                       "model_tflops_per_second": 3.1, "mfu": 0.41234, "memory/peak_allocated_gib": 3.214,
                       "memory/peak_reserved_gib": 4.0})
    line = buf.getvalue().splitlines()[-1]
    assert line.startswith("step 200/600 (33%)")
    assert line.endswith("1.23k samples/s  45.7k tokens/s  MFU 41.2%  peak mem 3.21 GiB  loss=0.25")
    assert format_throughput({"samples_per_second": 12.0, "model_tflops_per_second": 0.5}) == "12 samples/s  0.5 TFLOP/s"
    assert format_throughput({"loss": 1.0, "samples_per_second": float("nan")}) == ""


def test_the_report_plots_the_throughput_and_gives_its_medians(tmp_path):
    from cadence.reports.run_report import _panel_order, build_report

    pytest.importorskip("matplotlib")
    train(TokenTask(), 12, model_dir=tmp_path, peak_tflops=1e-6)
    records = read_metrics(tmp_path / "train")
    page = Path(build_report(str(tmp_path)).html).read_text()
    for key, label in (("samples_per_second", "samples/s"), ("tokens_per_second", "tokens/s")):
        median = statistics.median(r[key] for r in records)
        assert f"<th>{label}</th><td>median {median:.4g}, last {records[-1][key]:.4g} (train {key})</td>" in page
    mfu = statistics.median(r["mfu"] for r in records) * 100
    assert f"<th>MFU</th><td>median {mfu:.4g}%" in page
    for key in ("samples_per_second", "tokens_per_second", "mfu"):
        assert f"<td>train</td><td>{key}</td>" in page  # a row of the series table
    panels = [("eval", "accuracy"), ("train", "learning_rate"), ("train", "mfu"), ("train", "samples_per_second"),
              ("eval", "loss"), ("train", "tokens_per_second"), ("train", "steps_per_second"), ("train", "loss")]
    assert _panel_order(panels) == [
        ("train", "loss"), ("train", "steps_per_second"), ("train", "samples_per_second"),
        ("train", "tokens_per_second"), ("train", "mfu"), ("train", "learning_rate"), ("eval", "loss"),
        ("eval", "accuracy")]


def test_the_benchmark_quick_mode_runs_every_contender(monkeypatch):
    """``benchmarks/loop/throughput_overhead.py --quick`` end to end: every contender trains and logs what
    it promises; timings are not checked."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.loop import throughput_overhead

    result = throughput_overhead.run(quick=True)
    logged = {row["contender"]: set(row["logged"]) for row in result["rows"]}
    assert logged == {
        throughput_overhead.BASELINE: {"steps_per_second"},
        "samples/s (the default)": {"steps_per_second", "samples_per_second"},
        "samples/s + tokens/s (Task.tokens_per_batch)": {"steps_per_second", "samples_per_second", "tokens_per_second"},
        "samples/s + MFU (trainer.peak_tflops: FLOPs counted once)": {"steps_per_second", "samples_per_second",
                                                                      "model_tflops_per_second", "mfu"},
    }
    assert result["costs"]["flops_per_sample"] == mlp_flops_per_sample((32, 64, 10))
    assert "## Throughput logging overhead" in "\n".join(throughput_overhead.markdown_lines(result))
    from benchmarks import run as bench_run
    assert bench_run.BENCHMARKS["throughput"] is throughput_overhead.run  # part of `make bench`
