"""``cadence report``'s "Replica groups" part (:mod:`cadence.reports.replica_groups`) on fake
``metrics.jsonl`` files of a run of 3 replica groups: the steps with fewer groups as ranges, the
steps run again, the samples skipped and seen twice, per group and in total."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cadence.reports.replica_groups import read_replica_groups, replica_groups_of, replica_section, step_ranges


def write_metrics(directory: Path, rows: list[dict]) -> None:
    (directory / "train").mkdir(parents=True, exist_ok=True)
    (directory / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(step: int, replicas: int, retries: int = 0, skipped: int = 0, repeated: int = 0, short: int = 0) -> dict:
    return {"step": step, "time": 1.0, "loss": 0.5, "replicas": float(replicas), "replica_retries": float(retries),
            "replica_samples_skipped": float(skipped), "replica_samples_repeated": float(repeated),
            "replica_short_steps": float(short)}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Group 0 ran every loop of 2 steps (group 2 away over steps 5-8, group 1 over 11-12); group 1 was
    restarted (its rows resume at 14); group 2 logged two loops."""
    config = {"trainer": {"train_steps": 16, "fault_tolerance": {"replica_groups": 3}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    write_metrics(tmp_path, [row(2, 3), row(4, 3), row(6, 2, retries=1, skipped=8, short=1), row(8, 2, short=2),
                             row(10, 3), row(12, 2, retries=2, skipped=16, short=2), row(14, 3), row(16, 3)])
    write_metrics(tmp_path / "replicas" / "group1", [row(2, 3), row(4, 3), row(6, 2, 1, 8, short=1), row(8, 2, short=2),
                                                     row(10, 3),
                                                     row(14, 3, repeated=16), row(16, 3)])
    write_metrics(tmp_path / "replicas" / "group2", [row(2, 3), row(10, 3, repeated=24)])
    return tmp_path


def test_counts_per_group_and_in_total(model_dir: Path) -> None:
    summary = read_replica_groups(str(model_dir), replica_groups_of((model_dir / "config.yaml").read_text()))
    assert summary is not None and summary.groups == 3
    first, second, third = summary.counts
    assert (first.loops, first.short, first.retried) == (8, [(5, 8), (11, 12)], [(5, 6), (11, 12)])
    assert (first.retries, first.skipped, first.repeated, first.short_steps) == (3, 24, 0, 5)
    assert (second.loops, second.short, second.retries, second.skipped, second.repeated) == (7, [(5, 8)], 1, 8, 16)
    assert second.short_steps == 3 and third.short_steps == 0
    assert third.short == [] and third.repeated == 24  # its second row's loop counts from step 3 on
    assert summary.short == [(5, 8), (11, 12)]
    assert (summary.retries, summary.skipped, summary.repeated) == (4, 32, 40)
    html = replica_section(summary)
    assert "steps with fewer than 3 groups: 5-8, 11-12; steps run again: 4; samples skipped: 32; " \
           "samples seen twice: 40" in html
    assert "3 (5-6, 11-12)" in html  # group 0's retried loops
    assert "5 (5-8, 11-12)" in html and "3 (5-8)" in html  # each group's steps with fewer groups, counted


def test_without_a_config_the_groups_come_from_the_rows(model_dir: Path) -> None:
    (model_dir / "config.yaml").write_text("trainer: {}\n")
    summary = read_replica_groups(str(model_dir), None)
    assert summary is not None and summary.groups == 3 and summary.repeated == 40


def test_a_run_without_replica_groups_has_no_part(tmp_path: Path) -> None:
    write_metrics(tmp_path, [{"step": 2, "loss": 0.5}, {"step": 4, "loss": 0.4}])
    assert read_replica_groups(str(tmp_path), None) is None
    assert replica_groups_of("trainer: {train_steps: 4}\n") is None
    assert replica_groups_of("trainer: [") is None  # unreadable YAML


def test_step_ranges_merge_touching_spans() -> None:
    assert step_ranges([(7, 9), (1, 3), (4, 4), (10, 12), (20, 21)]) == [(1, 4), (7, 12), (20, 21)]
    assert step_ranges([]) == []


def test_the_report_page_has_the_part(model_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    from cadence.reports.run_report import build_report

    paths = build_report(str(model_dir))
    html = Path(paths.html).read_text()
    assert "<h2>Replica groups</h2>" in html and "samples seen twice: 40" in html
