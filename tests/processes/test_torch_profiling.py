"""Profiler traces on a schedule (the ``profiler:`` section, ``cadence train --profile``): the window
in global steps matches torch.profiler.schedule's, one trace per rank and cycle in the model dir
(local or fsspec) holds exactly the window's steps, a resumed run keeps the window, no profiler
runs outside it, the weights are those of a run without it, and bad settings are one-line errors."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cadence import Callback, Controller
from cadence.config import config_from_dict
from cadence.config.components.profiler import NEVER, ProfilerConfig
from cadence.torch import Context, build_runners, run_training
from cadence.torch.components.profiling import StepProfiler
from cli_run import ROOT, run_cadence, same_weights
from tasks import TinyTask

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
TRACE = re.compile(r"^rank(\d+)\.(\d+)\.pt\.trace\.json(\.gz)?$")


def settings(tmp_path: Path, model_dir: str | None = None, *, steps: int = 20, profiler: dict | None = None,
             **trainer) -> dict:
    data = {"model_dir": model_dir or str(tmp_path / "run"), "task": {"class": TASK},
            "trainer": {"train_steps": steps, "steps_per_loop": 4, "validation_interval": 8, "seed": 0, **trainer}}
    if profiler is not None:
        data["profiler"] = profiler
    return data


def load_trace(data: bytes) -> dict:
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def profiler_steps(trace: dict) -> list[int]:
    """The global steps of the trace's ProfilerStep#N markers, in order."""
    marks = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    return [int(e["name"].split("#")[1]) for e in sorted(marks, key=lambda e: e["ts"])]


def traces(directory: Path) -> dict[str, dict]:
    """Every trace file of a local ``profile/`` dir, by name, in the order written."""
    names = os.listdir(directory)
    assert all(TRACE.match(n) for n in names), names  # no temp file left, nothing else
    names.sort(key=lambda n: (int(TRACE.match(n)[1]), int(TRACE.match(n)[2])))
    return {n: load_trace((directory / n).read_bytes()) for n in names}


@pytest.mark.parametrize("skip_first,wait,warmup,active,repeat",
                         [(0, 0, 1, 1, 1), (10, 1, 1, 3, 1), (3, 2, 0, 2, 3), (5, 1, 2, 1, 0), (0, 3, 1, 2, 2)])
def test_the_window_is_torch_schedules_in_global_steps(skip_first, wait, warmup, active, repeat):
    """Global step s is torch's step s - 1: warmup, recording and nothing agree step by step."""
    from torch.profiler import ProfilerAction, schedule

    window = ProfilerConfig(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning for warmup=0
        torch_action = schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    for step in range(1, 80):
        action, cycle = torch_action(step - 1), window.cycle_of(step)
        assert (action != ProfilerAction.NONE) == (cycle is not None), step
        if cycle is not None:
            assert (action == ProfilerAction.WARMUP) == (step < cycle.first_active), step
            assert (action == ProfilerAction.RECORD_AND_SAVE) == (step == cycle.last_active), step
        start = window.next_start(step)  # the first step >= step that begins a traced cycle
        assert start >= step and (start == NEVER or window.starting_at(start) is not None)
        assert all(window.starting_at(s) is None for s in range(step, min(start, 80)))


def test_window_description_and_bounds():
    assert ProfilerConfig(skip_first=10, wait=1, warmup=1, active=3, repeat=1).describe() == "steps 13-15"
    assert ProfilerConfig(skip_first=3, wait=1, warmup=1, active=2, repeat=2).describe() == "steps 6-7, 10-11 (2 cycles)"
    assert ProfilerConfig(skip_first=0, wait=0, warmup=0, active=1, repeat=5).describe() == "steps 1, 2, 3, ..., 5 (5 cycles)"
    assert ProfilerConfig(skip_first=0, wait=1, warmup=1, active=1, repeat=0).describe() == (
        "steps 3, 6, 9, ... (every 3 steps until training ends)")
    with pytest.raises(ValueError, match="active must be >= 1"):
        ProfilerConfig(active=0)
    with pytest.raises(ValueError, match="wait must be >= 0"):
        ProfilerConfig(wait=-1)


class ProfilerState(Callback):
    """A per-step callback after the profiler: whether the profiler records while each next step runs."""

    def __init__(self) -> None:
        self.recording: dict[int, bool] = {}

    def on_train_step_end(self, run, step: int) -> None:
        self.recording[step + 1] = torch.autograd._profiler_enabled()


def test_no_profiler_outside_the_window_and_one_trace_per_cycle(tmp_path):
    """Driven through a Controller: the profiler records during the active steps only (a cycle
    starting at step 1 too, from on_train_start), and each cycle's trace holds exactly its steps."""
    trainer, _ = build_runners(TinyTask(), Context.create(device="cpu", seed=0), evaluate=False)
    window = ProfilerConfig(skip_first=0, wait=0, warmup=1, active=2, repeat=0)  # 2-3, 5-6, 8-9, ...
    profiler = StepProfiler(window, str(tmp_path / "profile"))
    state = ProfilerState()
    with Controller(trainer=trainer, steps_per_loop=5, callbacks=[profiler, state], progress=False) as controller:
        controller.train(10, checkpoint_at_completion=False)
        assert torch.autograd._profiler_enabled()  # the cycle of steps 11-12 began (warmup at 10)
    assert not torch.autograd._profiler_enabled()  # stopped on close
    assert {s for s, on in state.recording.items() if on} == {2, 3, 5, 6, 8, 9, 11}
    assert sorted(state.recording) == list(range(2, 12))
    written = traces(tmp_path / "profile")  # 11 never ran: nothing of cycle 11-12 is written
    assert [profiler_steps(t) for t in written.values()] == [[2, 3], [5, 6], [8, 9]]
    assert [f"{tmp_path / 'profile'}/{n}" for n in written] == profiler.traces
    for trace in written.values():
        assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])  # the model's forward
        assert trace["cadence"]["rank"] == 0


def test_a_trace_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "profile"
    blocker.write_text("a file where the directory should be")
    trainer, _ = build_runners(TinyTask(), Context.create(device="cpu", seed=0), evaluate=False)
    profiler = StepProfiler(ProfilerConfig(skip_first=1, wait=0, warmup=1, active=1), str(blocker))
    Controller(trainer=trainer, steps_per_loop=5, callbacks=[profiler], restore=False, progress=False)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        trainer.train(5)
    assert trainer.global_step == 5 and profiler.traces == []
    assert [r.getMessage() for r in caplog.records if "could not write the trace of steps 3" in r.getMessage()]
    assert blocker.read_text() == "a file where the directory should be"


def test_traces_hold_the_window_and_the_weights_are_unchanged(tmp_path):
    window = {"skip_first": 3, "wait": 1, "warmup": 1, "active": 2, "repeat": 2, "record_shapes": True}
    run_training(config_from_dict(settings(tmp_path, str(tmp_path / "plain"))), progress=False)
    run_training(config_from_dict(settings(tmp_path, profiler=window)), progress=False)
    written = traces(tmp_path / "run" / "profile")
    assert [profiler_steps(t) for t in written.values()] == [[6, 7], [10, 11]]  # an evaluation at 8: not in them
    assert [t["cadence"]["steps"] for t in written.values()] == [[6, 7], [10, 11]]
    addmm = [e for t in written.values() for e in t["traceEvents"] if e.get("name") == "aten::addmm"]
    assert addmm and all("Input Dims" in e["args"] for e in addmm)  # record_shapes
    final = "checkpoints/ckpt-20/model.safetensors"
    assert same_weights(load_file(tmp_path / "run" / final), load_file(tmp_path / "plain" / final))


def test_a_resumed_run_keeps_the_window_in_global_steps(tmp_path):
    """The first run ends at step 9 (train_steps), inside cycle 0's recorded steps 9-10: its trace
    holds step 9. The resumed run skips the rest of that cycle and traces cycle 1 (13-14) whole."""
    window = {"skip_first": 6, "wait": 1, "warmup": 1, "active": 2, "repeat": 2}
    run_training(config_from_dict(settings(tmp_path, steps=9, profiler=window, steps_per_loop=3,
                                           validation_interval=None)), progress=False)
    first = traces(tmp_path / "run" / "profile")
    assert [profiler_steps(t) for t in first.values()] == [[9]]
    run_training(config_from_dict(settings(tmp_path, steps=18, profiler=window, steps_per_loop=3,
                                           validation_interval=None)), progress=False)
    written = traces(tmp_path / "run" / "profile")
    assert list(written)[0] == list(first)[0]
    assert [profiler_steps(t) for t in written.values()] == [[9], [13, 14]]


def test_a_model_dir_on_an_fsspec_store_gets_gzipped_traces(tmp_path, monkeypatch):
    import fsspec

    url = f"memory://cadence-profiling-{os.getpid()}/run"
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))  # this test's own temp dir, no other's files
    temp = set(os.listdir(tempfile.gettempdir()))
    try:
        run_training(config_from_dict(settings(tmp_path, url, steps=8, validation_interval=None, profiler={
            "skip_first": 2, "wait": 0, "warmup": 1, "active": 2, "gzip": True})), progress=False)
        fs = fsspec.filesystem("memory")
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/profile", detail=False)]
        assert len(names) == 1 and TRACE.match(names[0]) and names[0].endswith(".pt.trace.json.gz"), names
        data = fs.cat(f"{url}/profile/{names[0]}")
        assert data[:2] == b"\x1f\x8b" and profiler_steps(load_trace(data)) == [4, 5]
    finally:
        fsspec.filesystem("memory").rm(f"memory://cadence-profiling-{os.getpid()}", recursive=True)
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - temp if n.startswith("cadence-trace-")]


def write_config(tmp_path: Path, **kwargs) -> Path:
    data = settings(tmp_path, **kwargs)
    del data["model_dir"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cadence_train_profile_on_two_ranks_writes_a_trace_per_rank(tmp_path):
    """--profile on a config without a profiler section: its defaults (steps 13-15), on both ranks."""
    model_dir = tmp_path / "run"
    proc = run_cadence("train", str(write_config(tmp_path, steps=16, validation_interval=None)), "--model-dir",
                       str(model_dir), "--nproc", "2", "--profile", "--no-progress", env={"COLUMNS": "250"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "profiler: tracing steps 13-15 into" in out
    written = traces(model_dir / "profile")
    assert sorted(TRACE.match(n)[1] for n in written) == ["0", "1"]
    for name, trace in written.items():
        assert profiler_steps(trace) == [13, 14, 15]
        assert trace["cadence"]["rank"] == int(TRACE.match(name)[1])
        assert trace["distributedInfo"]["world_size"] == 2  # what the plugin's distributed view reads
    assert yaml.safe_load((model_dir / "config.yaml").read_text())["profiler"]["active"] == 3


def test_cadence_train_profile_keeps_the_configs_own_window(tmp_path):
    model_dir = tmp_path / "run"
    config = write_config(tmp_path, steps=8, validation_interval=None,
                          profiler={"skip_first": 1, "wait": 0, "warmup": 1, "active": 1, "repeat": 3})
    proc = run_cadence("train", str(config), "--model-dir", str(model_dir), "--profile", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [profiler_steps(t) for t in traces(model_dir / "profile").values()] == [[3], [5], [7]]


@pytest.mark.parametrize("override,message", [
    ("profiler.active=0", "profiler.active: expected an integer >= 1, got 0"),
    ("profiler.skip_first=-2", "profiler.skip_first: expected an integer >= 0, got -2"),
    ("profiler.with_stack=yes", "profiler.with_stack: expected true or false, got 'yes'"),
    ("profiler.activ=3", "unknown field 'profiler.activ' (did you mean 'profiler.active'?)"),
])
def test_bad_profiler_settings_are_one_line_errors(tmp_path, override, message):
    model_dir = tmp_path / "run"
    proc = run_cadence("train", str(write_config(tmp_path)), "--model-dir", str(model_dir), "--profile",
                       "--set", override, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not model_dir.exists()


def test_the_overhead_benchmark_runs(monkeypatch):
    """benchmarks/loop/profiler_overhead.py's quick mode: both contenders timed, the profiled ones wrote
    the default window's trace before their timed steps, the reference window its own. Timings are
    not checked."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.loop import profiler_overhead

    result = profiler_overhead.run(quick=True)
    assert [row["contender"] for row in result["rows"]] == list(profiler_overhead.CONTENDERS)
    assert all(row["cpu_us_per_step_median"] > 0 and row["wall_ratio_median"] > 0 for row in result["rows"])
    assert result["traces_in_warmup"] == result["repeats"] and result["inside"]["traces"] == 1
    assert result["hook_ns_per_step"] > 0
    assert "## Profiler overhead outside its window" in "\n".join(profiler_overhead.markdown_lines(result))


def test_a_smoke_run_traces_nothing(tmp_path, caplog):
    """cadence smoke trains a config's first steps: a profiler section is left out (no trace, no
    warning that the window lies past the smoke run's end)."""
    from cadence.torch import run_smoke

    keep = tmp_path / "kept"
    cfg = config_from_dict(settings(tmp_path, profiler={"skip_first": 0, "wait": 0, "warmup": 0, "active": 1}))
    with caplog.at_level(logging.INFO, logger="cadence"):
        report = run_smoke(cfg, steps=2, keep_dir=str(keep))
    assert report.ok, report.failed
    assert (keep / "checkpoints").is_dir() and not (keep / "profile").exists()
    assert not [r for r in caplog.records if "profiler" in r.getMessage()]


def test_a_rollback_inside_the_window_ends_the_trace(tmp_path, caplog):
    """NaN recovery rolls the global step back between two loops: the trace of the steps recorded
    so far is written, and the cycle is traced again, whole, as its steps run again."""
    profiler = StepProfiler(ProfilerConfig(skip_first=1, wait=0, warmup=1, active=4), str(tmp_path))
    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        for step in (1, 2, 3, 4, 2, 3, 4, 5, 6):  # steps 1-4, rolled back to 1, steps 2-6
            x = torch.tanh(x @ x)
            profiler.on_train_step_end(None, step)  # it needs no run here
    assert len(profiler.traces) == 2
    cut, again = traces(tmp_path).values()
    assert cut["cadence"]["steps"] == [3, 4]
    assert profiler_steps(cut) == [3, 4, 5]  # the marker of step 5: until the rollback
    assert again["cadence"]["steps"] == [3, 6] and profiler_steps(again) == [3, 4, 5, 6]
    assert any("went from 5 to 2" in r.getMessage() for r in caplog.records)
    assert not torch.autograd._profiler_enabled()


def test_the_step_profiler_reads_the_configs_own_settings(tmp_path):
    """`profiler:` is the model StepProfiler takes: its window and its options, with the section's defaults."""
    from cadence.torch.components.profiling import build_step_profiler

    cfg = config_from_dict({"model_dir": str(tmp_path), "task": {"class": "a:B"},
                            "profiler": {"skip_first": 2, "gzip": True, "record_shapes": True}})
    assert isinstance(cfg.profiler, ProfilerConfig)
    profiler = build_step_profiler(cfg.profiler, str(tmp_path), Context.create(device="cpu", seed=0), train_steps=50)
    assert profiler.window is cfg.profiler
    assert (profiler.gzip, profiler.record_shapes, profiler.profile_memory, profiler.with_stack) == (True, True, False, False)
    assert profiler.window.describe() == "steps 5-7"  # skip 2, then the defaults: wait 1, warmup 1, active 3
    assert StepProfiler(ProfilerConfig(), str(tmp_path)).window.describe() == "steps 13-15"
