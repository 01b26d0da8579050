"""The benchmarks' quick modes run end to end: every checkpoint contender saves, loads back exactly
what it saved (checked), the loops run the same steps, and the reports render. Timings are not checked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from cli_run import run_python
from zygote import forking_children

ROOT = Path(__file__).resolve().parents[2]  # holds the package `benchmarks`


def test_checkpoint_benchmark_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.checkpoint import throughput as checkpoint_throughput

    from benchmarks import run as bench_run

    result = checkpoint_throughput.run(quick=True, root=str(tmp_path), sizes={"tiny": 64})
    (size,) = result["sizes"]
    assert {row["key"] for row in size["rows"]} == set(checkpoint_throughput.CONTENDERS)
    for row in size["rows"]:
        assert row["save_s_median"] > 0 and row["save_ratio_median"] > 0
        assert ("load_s_median" in row) == (row["key"] != "floor")
    assert "async" not in size  # the stall benchmark's (test_checkpoint_stall_benchmark_quick)
    assert len(size["targets"]) == len(checkpoint_throughput.TARGETS)
    assert list(tmp_path.iterdir()) == []  # every directory written was deleted
    text = bench_run.markdown({"machine": bench_run.machine(), "checkpoint": result})
    assert "torch.distributed.checkpoint" in text and "Targets, cadence (crc32c)" in text


def test_sharded_checkpoint_benchmark_quick(tmp_path, monkeypatch):
    """The sharded benchmark's quick mode on 1, 2 and 3 torchrun ranks: both contenders save and load
    back exactly what they saved (checked on every rank), and the table it writes has a row per
    world size and contender."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.checkpoint import sharded as sharded_checkpoint

    out = tmp_path / "results" / "sharded.md"
    root = tmp_path / "ckpt"
    root.mkdir()
    proc = run_python([str(ROOT / "benchmarks" / "checkpoint" / "sharded.py"), "--quick", "--root", str(root), "--out", str(out)],
                      timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(root.iterdir()) == []  # every checkpoint written was deleted
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["quick"] and [row["world_size"] for row in result["rows"]] == list(sharded_checkpoint.WORLD_SIZES)
    for row in result["rows"]:
        assert set(row["contenders"]) == {"dcp", "cadence"}
        for c in row["contenders"].values():
            assert c["save_s_median"] > 0 and c["load_s_median"] > 0 and c["bytes_written"] > 0
        assert row["save_ratio"] > 0 and row["load_ratio"] > 0
        assert 0 < row["checksum_save_share"] < 1 and 0 < row["verify_load_share"] < 1
    text = out.read_text()
    for n in sharded_checkpoint.WORLD_SIZES:
        assert f"\n| {n} | plain DCP (dcp.save / dcp.load) |" in text
        assert f"\n| {n} | cadence (CheckpointSession, crc32c) |" in text
    assert "## Sharded checkpoint save and load under FSDP2" in text
    from benchmarks import run as bench_run
    assert bench_run.BENCHMARKS["sharded"] is sharded_checkpoint.run  # part of `make bench`


def test_goodput_benchmark_quick(tmp_path, monkeypatch):
    """The goodput benchmark's quick mode: a 2-rank run without faults and one whose ranks are
    SIGKILLed once (when its attempt has run 25 steps) both finish, with bit-identical weights
    (checked by the benchmark), and the table renders."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.faults import goodput

    with forking_children():  # its cadence processes forked from the tests' zygote
        result = goodput.run(quick=True, root=str(tmp_path))
    clean, faulty = result["clean"], result["faulty"]
    assert result["identical_weights"] and clean["restarts"] == 0 and clean["lost_steps"] == 0
    assert len(faulty["kills"]) == 1 and faulty["restarts"] == 1 and faulty["lost_steps"] > 0
    assert clean["steps_kept"] == faulty["steps_kept"] == result["steps"] <= faulty["steps_run"]
    assert 0 < faulty["goodput"] < 1 and 0 < clean["goodput"] < 1  # their ratio is timing: the benchmark's to report
    assert list(tmp_path.iterdir()) == []  # the runs' directories were deleted
    text = "\n".join(goodput.markdown_lines(result))
    assert "## Goodput under failures" in text and "| a rank killed after 25 steps, once |" in text
    from benchmarks import run as bench_run
    assert bench_run.BENCHMARKS["goodput"] is goodput.run  # part of `make bench`


def test_goodput_nodes_benchmark_quick(tmp_path, monkeypatch):
    """The node-loss goodput benchmark's quick mode: a two-node job (one rank per node) without faults and
    one whose node 1 is lost once (SIGKILL to its agent's process group and worker) and started again both
    finish, with bit-identical weights (checked by the benchmark), and the table renders."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.faults import goodput_nodes

    with forking_children():  # its cadence processes forked from the tests' zygote
        result = goodput_nodes.run(quick=True, root=str(tmp_path))
    clean, (faulty,) = result["clean"], result["faulty"]
    assert result["identical_weights"] and clean["kills"] == [] and clean["lost_steps"] == 0
    (kill,) = faulty["kills"]
    assert faulty["attempts"] >= 2 and faulty["lost_steps"] > 0
    assert 0 < kill["stop_s"] < kill["recover_s"] and kill["rendezvous_s"] > 0 and kill["start_s"] > 0
    assert clean["steps_kept"] == faulty["steps_kept"] == result["steps"] < faulty["steps_run"]
    assert list(tmp_path.iterdir()) == []  # the runs' directories were deleted
    text = "\n".join(goodput_nodes.markdown_lines(result))
    assert "## Goodput under node loss" in text and "| node 1 lost after 15 steps, 1 time(s), keep-alive 1 s x 4 |" in text
    assert "82.3% of steps committed with a failure every 60 s" in text
    from benchmarks import run as bench_run
    assert bench_run.BENCHMARKS["goodput_nodes"] is goodput_nodes.run  # part of `make bench`


def test_checkpoint_stall_benchmark_quick(tmp_path, monkeypatch):
    """The stall benchmark's quick mode (a tiny state and a tiny charlm, two saves each): every
    contender saves while training, the stalls, step ratios and peak RSS are positive, the table
    renders with a row per contender and the targets, and it is part of `make bench`. Timings are
    not compared (a noisy machine)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.checkpoint import stall as checkpoint_stall

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `make bench` trains (OMP_NUM_THREADS=1); 2 threads on 2 busy cores crawl
    try:
        result = checkpoint_stall.run(quick=True, root=str(tmp_path), sizes={"tiny": 64})
    finally:
        torch.set_num_threads(threads)
    assert [s["label"] for s in result["states"]] == ["tiny", "charlm"]
    for state in result["states"]:
        rows = {row["key"]: row for row in state["rows"]}
        assert list(rows) == list(checkpoint_stall.CONTENDERS)
        assert all(row["stall_s"] > 0 and row["stall_fraction"] > 0 for row in rows.values())
        for key in ("boundary", "pipelined", "dcp"):
            row = rows[key]
            assert row["first_stall_s"] > 0 and len(row["stalls_s"]) == 2 and row["boundary_s"] > 0
            assert row["wait_s"] >= 0 and row["background_s"] >= row["boundary_s"]
            assert row["steps_idle"] >= 2 and row["steps_during_save"] >= 1 and row["step_ratio_during_save"] > 0
            assert row["peak_rss_x_state"] > 1 and row["rss_alone_x_state"] > 1
        assert {t["name"] for t in state["targets"]} <= set(checkpoint_stall.TARGETS)
        assert all(t["met"] in (True, False) for t in state["targets"])
    assert list(tmp_path.iterdir()) == []  # every checkpoint written was deleted
    text = "\n".join(checkpoint_stall.markdown_lines(result))
    assert text.count("## Checkpoint stall") == 2 and text.count("Targets, cadence pipelined: ") == 2
    for contender in checkpoint_stall.CONTENDERS.values():
        assert text.count(f"\n| {contender} | ") == 2
    from benchmarks import run as bench_run
    assert bench_run.BENCHMARKS["stall"] is checkpoint_stall.run  # part of `make bench`
    assert "## Checkpoint stall" in bench_run.markdown({"machine": bench_run.machine(), "stall": result})


def test_gpu_loop_benchmark_quick_on_cpu(monkeypatch):
    """The GPU loop benchmark's smoke test (``--quick --device cpu``: a 2-layer GPT-2, bf16 autocast, eager and
    aot_eager): both contenders run the same number of steps and, running the same ops on the same inputs and
    weights, the same loss at step 1 (an untrained model's: about ln(vocabulary)); the table renders with the
    paired ratio, no MFU off CUDA. Timings are not compared."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.loop import gpu_loop

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = gpu_loop.run("cpu", quick=True)
    finally:
        torch.set_num_threads(threads)
    q = gpu_loop.QUICK
    assert [s["compile"] for s in result["settings"]] == [None, "aot_eager"]
    for setting in result["settings"]:
        rows = {row["contender"]: row for row in setting["rows"]}
        assert list(rows) == list(gpu_loop.CONTENDERS)
        hand, cadence = rows["hand-written"], rows["cadence"]
        assert hand["steps"] == cadence["steps"] == 1 + (q["warmup"] - 1) + q["steps"] * q["repeats"]
        assert hand["first_loss"] == cadence["first_loss"]
        assert abs(hand["first_loss"] - math.log(q["config"]["vocab_size"])) < 0.5
        assert all(row["ms_per_step_median"] > 0 and row["mfu"] is None for row in rows.values())
        assert setting["ratio_paired"] > 0 and setting["flops_per_step"] > 0 and setting["peak_flops"] is None
    text = "\n".join(gpu_loop.markdown_lines(result))
    assert "| off | cadence |" in text and "| aot_eager | hand-written |" in text and "Target <= 1.01x" in text
