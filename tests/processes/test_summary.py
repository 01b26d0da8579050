"""SummaryWriter and SummaryManager: TensorBoard events + metrics.jsonl, read back with tensorboard's
own reader."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cadence.summaries import manager as summary
from cadence.summaries.metrics_file import read_metrics
from cadence.summaries.scalars import flatten_scalars, to_scalar
from cadence.summaries.writer import SummaryWriter


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_writes_tensorboard_events(tmp_path: Path) -> None:
    logdir = tmp_path / "train"
    with SummaryWriter(logdir) as w:
        w.write(100, {"loss": 0.5, "accuracy": np.float32(0.25)})
        w.write(200, {"loss": 0.125, "accuracy": np.array(0.75)})
    assert list(logdir.glob("events.out.tfevents.*"))
    got = scalars(logdir)
    assert got["loss"] == [(100, 0.5), (200, 0.125)]
    assert got["accuracy"] == [(100, 0.25), (200, 0.75)]


def test_metrics_jsonl_content(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w:
        w.write(10, {"loss": 0.5, "count": np.int64(3), "flag": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert list(record)[:2] == ["step", "time"]
    assert record["step"] == 10 and isinstance(record["time"], float)
    assert record["loss"] == 0.5
    assert record["count"] == 3 and isinstance(record["count"], int)
    assert record["flag"] == 1


def test_dir_created_lazily(tmp_path: Path) -> None:
    logdir = tmp_path / "a" / "b"
    w = SummaryWriter(logdir)
    assert not logdir.exists()
    w.write(1, {"x": "not a scalar"})  # nothing scalar: nothing written
    assert not logdir.exists()
    w.write(1, {"x": 1.0})
    w.close()
    assert (logdir / "metrics.jsonl").exists()


def test_nested_flattening_and_non_scalars_skipped(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w:
        w.write(
            5,
            {
                "loss": 1.0,
                "eval": {"top1": 0.5, "per_class": {"cat": 0.25}},
                "name": "digits",
                "hist": np.zeros(4),
                "values": [1, 2],
                "nothing": None,
                "cplx": 1 + 2j,
            },
        )
    (record,) = read_metrics(tmp_path)
    assert {k: v for k, v in record.items() if k != "time"} == {
        "step": 5,
        "loss": 1.0,
        "eval/top1": 0.5,
        "eval/per_class/cat": 0.25,
    }
    assert set(scalars(tmp_path)) == {"loss", "eval/top1", "eval/per_class/cat"}


def test_nan_and_inf_round_trip(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w:
        w.write(1, {"nan": float("nan"), "inf": np.float64("inf"), "ninf": -math.inf})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" in text and "-Infinity" in text
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(record["nan"]) and record["inf"] == math.inf and record["ninf"] == -math.inf
    got = scalars(tmp_path)
    assert math.isnan(got["nan"][0][1]) and got["inf"][0][1] == math.inf


def test_append_across_writers(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w:
        w.write(1, {"loss": 1.0})
        w.write(2, {"loss": 0.5})
    with SummaryWriter(tmp_path) as w:  # a restarted run
        w.write(3, {"loss": 0.25})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    # two event files, both read by TensorBoard
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert scalars(tmp_path)["loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_event_files_of_one_process_sort_in_the_order_they_were_opened(tmp_path: Path) -> None:
    """tensorboard names a file ``...tfevents.<second>.<host>.<pid>.<n>`` with an unpadded per-process ``n``:
    readers take files in name order, and ``.9`` sorts after ``.10``. Writers opened one after the other get
    files of different seconds, whose names sort in the order of creation."""
    for step in range(3):
        with SummaryWriter(tmp_path, purge_step=step if step else None) as w:
            w.write(step, {"loss": float(step)})
    names = [p.name for p in tmp_path.glob("events.out.tfevents.*")]
    created = sorted(names, key=lambda name: int(name.rsplit(".", 1)[1]))  # the counter: the order of creation
    assert sorted(names) == created
    assert len({name.split(".")[3] for name in names}) == 3  # three different seconds
    assert scalars(tmp_path)["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w:
        w.write(1, {"loss": 1.0})
        w.write(2, {"loss": 0.5})
    path = tmp_path / "metrics.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 12])  # killed mid-write
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_append_after_truncation_repairs_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0.0, "loss": 1.0}\n{"step": 2, "ti')
    with SummaryWriter(tmp_path) as w:
        w.write(3, {"loss": 0.25})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 3]
    assert path.read_text().endswith("\n")


def test_complete_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0.0, "loss": 1.0}')
    with SummaryWriter(tmp_path) as w:
        w.write(2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_corrupt_middle_line_warns(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.warns(UserWarning, match="line 2"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_read_metrics_missing_file(tmp_path: Path) -> None:
    assert read_metrics(tmp_path / "nope") == []
    assert read_metrics(tmp_path / "nope" / "metrics.jsonl") == []


def test_flush_makes_events_readable(tmp_path: Path) -> None:
    w = SummaryWriter(tmp_path)
    w.write(7, {"loss": 2.0})
    w.flush()
    assert scalars(tmp_path)["loss"] == [(7, 2.0)]
    assert read_metrics(tmp_path)[0]["loss"] == 2.0
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write(8, {"loss": 1.0})


def test_reserved_keys_stay_out_of_jsonl(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.write(3, {"step": 99, "time": 1.0, "loss": 0.5})
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 3 and record["time"] != 1.0


def test_fsspec_url_writes_jsonl_and_uploads_events(tmp_path: Path) -> None:
    import fsspec
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    url = f"memory://cadence-test/{tmp_path.name}/train"
    with SummaryWriter(url) as w:
        w.write(1, {"loss": 1.0})
        w.write(2, {"loss": 0.5})
        w.flush()  # the event file is uploaded at each flush
        fs = fsspec.filesystem("memory")
        assert [p for p in fs.ls(url, detail=False) if "tfevents" in p]
    with SummaryWriter(url, purge_step=3) as w:
        w.write(3, {"loss": 0.25})
    assert [r["step"] for r in read_metrics(url)] == [1, 2, 3]
    assert [r["loss"] for r in read_metrics(url + "/metrics.jsonl")] == [1.0, 0.5, 0.25]
    local = tmp_path / "events"
    local.mkdir()
    names = [p for p in fs.ls(url, detail=False) if "tfevents" in p]
    assert len(names) == 2  # one per writer, each uploaded whole
    for name in names:
        (local / name.rsplit("/", 1)[-1]).write_bytes(fs.cat_file(name))
    acc = EventAccumulator(str(local))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_to_scalar() -> None:
    class Tensorish:
        def __init__(self, v: object) -> None:
            self.v = v

        def item(self) -> object:
            if isinstance(self.v, list):
                raise ValueError("only one element tensors can be converted")
            return self.v

    assert to_scalar(3) == 3 and isinstance(to_scalar(3), int)
    assert to_scalar(np.float16(0.5)) == 0.5
    assert to_scalar(np.array(2)) == 2
    assert to_scalar(Tensorish(1.5)) == 1.5
    assert to_scalar(Tensorish([1, 2])) is None
    assert to_scalar(Tensorish("x")) is None
    assert to_scalar("1.0") is None
    assert to_scalar(np.ones(2)) is None
    assert to_scalar(None) is None
    assert flatten_scalars({"a": {"b": 1, 2: 3.0}}) == {"a/b": 1, "a/2": 3.0}


def test_imports_stay_light() -> None:
    """Importing these modules pulls in neither torch nor tensorboard (in a fresh process)."""
    code = (
        "import sys, cadence.summaries.writer, cadence.summaries.manager, cadence.summaries.progress, cadence.config\n"
        "sys.exit('torch' in sys.modules or 'tensorboard' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------ SummaryManager (Orbit's)


def test_summary_manager_writes_nested_outputs_to_subdirectories(tmp_path: Path) -> None:
    """Orbit's layout: flat entries in the directory, each top-level mapping in a subdirectory
    of its own (TensorBoard draws the datasets as curves of one chart); metrics.jsonl keeps all."""
    manager = summary.SummaryManager(tmp_path / "eval")
    manager.write_summaries(5, {"loss": 0.5, "ds1": {"accuracy": 0.9, "deep": {"x": 1.0}}, "ds2": {"accuracy": 0.8}})
    manager.write_summaries(10, {"loss": 0.25, "ds1": {"accuracy": 0.95}, "ds2": {"accuracy": 0.85}})
    manager.close()
    assert scalars(tmp_path / "eval") == {"loss": [(5, 0.5), (10, 0.25)]}
    assert scalars(tmp_path / "eval" / "ds1") == {"accuracy": [(5, pytest.approx(0.9)), (10, pytest.approx(0.95))],
                                                   "deep/x": [(5, 1.0)]}
    assert scalars(tmp_path / "eval" / "ds2") == {"accuracy": [(5, pytest.approx(0.8)), (10, pytest.approx(0.85))]}
    records = read_metrics(tmp_path / "eval")
    assert [(r["step"], r["loss"], r["ds1/accuracy"], r["ds2/accuracy"]) for r in records] == [
        (5, 0.5, 0.9, 0.8), (10, 0.25, 0.95, 0.85)]
    assert not (tmp_path / "eval" / "ds1" / "metrics.jsonl").exists()  # one record per step, in one file


def test_summary_manager_disabled_or_without_a_directory_writes_nothing(tmp_path: Path) -> None:
    for manager in (summary.SummaryManager(tmp_path / "off", enabled=False), summary.SummaryManager(None)):
        manager.write_summaries(1, {"loss": 1.0, "ds": {"a": 1.0}})
        manager.flush()
        manager.close()
        manager.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


def test_summary_manager_writes_again_after_close(tmp_path: Path) -> None:
    manager = summary.SummaryManager(tmp_path)
    manager.write_summaries(1, {"loss": 1.0})
    manager.close()
    manager.write_summaries(2, {"loss": 0.5})
    manager.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_summary_manager_flushed_writes_are_readable_before_close(tmp_path: Path) -> None:
    """The controller's use: write_summaries then flush after each evaluation, close at the end."""
    manager = summary.SummaryManager(tmp_path / "eval")
    manager.write_summaries(100, {"ds1": {"accuracy": 0.5}, "ds2": {"accuracy": 0.25}})  # nested only
    manager.flush()
    assert scalars(tmp_path / "eval" / "ds1") == {"accuracy": [(100, 0.5)]}
    assert scalars(tmp_path / "eval" / "ds2") == {"accuracy": [(100, 0.25)]}
    assert not list((tmp_path / "eval").glob("events.out.tfevents.*"))  # no flat entry: no root events
    assert [(r["step"], r["ds1/accuracy"]) for r in read_metrics(tmp_path / "eval")] == [(100, 0.5)]
    manager.close()
    manager.close()  # idempotent
    manager.flush()  # nothing left to flush: harmless


def test_summary_manager_skips_non_scalars_and_empty_mappings(tmp_path: Path) -> None:
    manager = summary.SummaryManager(tmp_path)
    manager.write_summaries(3, {"loss": np.float32(0.5), "name": "run", "ds": {}, "per_class": {"a": np.ones(2)}})
    manager.close()
    assert scalars(tmp_path) == {"loss": [(3, 0.5)]}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []  # no scalar inside: no subdirectory
    assert [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path)] == [{"step": 3, "loss": 0.5}]


def test_the_controller_writes_summaries_before_its_actions_run(tmp_path: Path) -> None:
    """Differs from Orbit (which runs the actions first): an action that stops training, in the
    train loop or after an evaluation, does not lose that output's summaries."""
    from cadence import Controller, StopTraining
    from fakes import FakeTrainer

    class Evaluator:
        def evaluate(self, num_steps: int) -> dict[str, float]:
            return {"accuracy": 0.5, "ds1": {"accuracy": 0.25}}

    def stop(output: object) -> None:
        raise StopTraining("enough")

    for kind in ("train", "eval"):
        root = tmp_path / kind
        with Controller(trainer=FakeTrainer(), evaluator=Evaluator(), steps_per_loop=2,
                        summary_dir=str(root / "train"), eval_summary_dir=str(root / "eval"), progress=False,
                        train_actions=[stop] if kind == "train" else [],
                        eval_actions=[stop] if kind == "eval" else []) as controller:
            controller.train_and_evaluate(10, eval_interval=4)
        stopped_at = 2 if kind == "train" else 4
        assert [r["step"] for r in read_metrics(root / "train")][-1] == stopped_at
        assert [(r["step"], r["ds1/accuracy"]) for r in read_metrics(root / "eval")] == [(stopped_at, 0.25)]
        assert scalars(root / "eval" / "ds1") == {"accuracy": [(stopped_at, 0.25)]}
