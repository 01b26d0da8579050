"""The checkpoint benchmark's quick mode runs end to end: every contender saves, loads back exactly
what it saved (checked), and the report renders. Timings are not checked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_checkpoint_benchmark_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import checkpoint_throughput

    spec = importlib.util.spec_from_file_location("cadence_benchmarks_run", BENCHMARKS / "run.py")
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)

    result = checkpoint_throughput.run(quick=True, root=str(tmp_path), sizes={"tiny": 64})
    (size,) = result["sizes"]
    assert {row["key"] for row in size["rows"]} == set(checkpoint_throughput.CONTENDERS)
    for row in size["rows"]:
        assert row["save_s_median"] > 0 and row["save_ratio_median"] > 0
        assert ("load_s_median" in row) == (row["key"] != "floor")
    assert size["async"]["saves"] == 2 and size["async"]["steady_stall_s"] >= 0
    assert len(size["targets"]) == len(checkpoint_throughput.TARGETS)
    assert list(tmp_path.iterdir()) == []  # every directory written was deleted
    text = bench_run.markdown({"machine": bench_run.machine(), "checkpoint": result})
    assert "torch.distributed.checkpoint" in text and "Targets, cadence (crc32c)" in text
