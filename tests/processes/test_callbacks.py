"""Callbacks: when each hook fires (in process, with the real Controller and CheckpointManager and
the fake trainer), how the config builds them, and SIGTERM in a real ``cadence train``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_run import popen
from fakes import MODEL_FILE, FakeTrainer

from cadence import Callback, Controller, StopTraining
from cadence.checkpoint import CheckpointManager
from cadence.errors import ConfigError

TESTS = Path(__file__).resolve().parents[1]


class FakeEvaluator:
    """Evaluates the fake trainer's model: ``{"value": trainer.value}``."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer

    def evaluate(self, num_steps: int) -> dict[str, Any]:
        return {"value": self.trainer.value}


class RollbackTrainer(FakeTrainer):
    """Accepts the keywords of ``Controller.rollback()``."""

    def load_checkpoint(self, reader, state, restore_data: bool = True, restore_rng: bool = True):
        super().load_checkpoint(reader, state)


class RestoringEvaluator(FakeEvaluator):
    """Restores the fake model it evaluates (for ``evaluate_continuously``)."""

    def load_checkpoint(self, reader, state):
        model = json.loads(reader.read(MODEL_FILE))
        self.trainer.step, self.trainer.value = model["step"], model["value"]


class Recorder(Callback):
    """Records ``(event, detail)`` tuples into ``events`` (shared between callbacks)."""

    def __init__(self, events: list, name: str = "rec") -> None:
        self.events = events
        self.name = name
        self.runs: list[Any] = []  # the run each hook was given

    def attach(self, run: Any) -> None:
        self.runs.append(run)
        self.events.append(("attach", None))

    def on_train_start(self, run: Any) -> None:
        self.runs.append(run)
        self.events.append(("train_start", run.global_step))

    def on_train_end(self, run: Any) -> None:
        self.runs.append(run)
        final = run.checkpoint_manager.final_step() if run.checkpoint_manager else None
        self.events.append(("train_end", (run.global_step, final)))

    def on_checkpoint_save(self, run: Any, checkpoint_dir: str) -> None:
        committed = Path(checkpoint_dir, "MANIFEST.json").exists()
        main = threading.current_thread() is threading.main_thread()
        self.events.append(("save", (Path(checkpoint_dir).name, committed, main)))

    def on_checkpoint_load(self, run: Any, checkpoint_dir: str) -> None:
        self.events.append(("load", Path(checkpoint_dir).name))

    def on_eval_end(self, run: Any, metrics: dict, step: int) -> None:
        self.events.append(("eval_end", (step, metrics["value"])))

    def on_close(self, run: Any) -> None:
        self.events.append(("close", self.name))


class Counter(Callback):
    """A stateful callback: counts evaluations over the whole run, across restarts."""

    def __init__(self) -> None:
        self.evaluations = 0

    def on_eval_end(self, run: Any, metrics: dict, step: int) -> None:
        self.evaluations += 1

    def state_dict(self) -> dict:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.evaluations = state["evaluations"]


class WriteMetadata(Callback):
    """The docstring's example: metadata written into each committed checkpoint."""

    def on_checkpoint_save(self, run: Any, checkpoint_dir: str) -> None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=TESTS,
                                check=False).stdout.strip()
        meta = {"step": run.global_step, "git_commit": commit or None, "hostname": socket.gethostname()}
        with open(os.path.join(checkpoint_dir, "metadata.json"), "w") as f:
            json.dump(meta, f)


class LocalNonChief:
    """A coordinator for rank 1 of 2 whose collectives return at once (nobody else runs)."""

    rank = 1
    world_size = 2
    is_chief = False

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def barrier(self) -> None:
        pass

    def broadcast(self, obj, src=0):
        return obj

    def all_gather(self, obj):
        return [obj, obj]


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    kw.setdefault("max_to_keep", None)
    return CheckpointManager(str(tmp_path / "checkpoints"), **kw)


def controller(tmp_path: Path, callbacks, trainer: FakeTrainer | None = None, **kw) -> Controller:
    trainer = trainer or FakeTrainer()
    kw.setdefault("checkpoint_manager", manager(tmp_path))
    kw.setdefault("checkpoint_interval", 2)
    return Controller(trainer=trainer, evaluator=FakeEvaluator(trainer), steps_per_loop=2,
                      callbacks=callbacks, progress=False, **kw)


# ------------------------------------------------------------------ order and count


def test_train_and_evaluate_fires_each_hook_in_order(tmp_path):
    events: list = []
    recorder = Recorder(events)
    with controller(tmp_path, [recorder]) as c:
        c.train_and_evaluate(train_steps=4, eval_interval=2)
    assert len(recorder.runs) == 3 and all(run is c for run in recorder.runs)  # every hook is given the run
    assert events == [
        ("attach", None),
        ("train_start", 0),
        ("eval_end", (2, 3)),
        ("save", ("ckpt-2", True, True)),  # committed after the evaluation at its step
        ("eval_end", (4, 10)),
        ("save", ("ckpt-4", True, True)),
        ("train_end", (4, 4)),  # after the final checkpoint and FINAL
        ("close", "rec"),
    ]


def test_train_fires_start_save_end_and_close_once(tmp_path):
    events: list = []
    c = controller(tmp_path, [Recorder(events)])
    c.train(5)
    c.close()
    c.close()  # on_close runs once
    assert events == [("attach", None), ("train_start", 0), ("save", ("ckpt-2", True, True)),
                      ("save", ("ckpt-4", True, True)), ("save", ("ckpt-5", True, True)),
                      ("train_end", (5, 5)), ("close", "rec")]


def test_callbacks_fire_in_list_order_and_subclasses_override_only_some_hooks(tmp_path):
    events: list = []

    class OnlyClose(Callback):  # every other hook is the base class's no-op
        def on_close(self, run: Any) -> None:
            events.append(("close", "only"))

    with controller(tmp_path, [Recorder(events, "a"), OnlyClose(), Recorder(events, "b")]) as c:
        c.train(2, checkpoint_at_completion=False)
    assert [e for e in events if e[0] == "close"] == [("close", "a"), ("close", "only"), ("close", "b")]
    assert [e[0] for e in events].count("train_start") == 2


def test_a_callback_must_be_a_callback_subclass(tmp_path):
    class DuckTyped:  # has a hook, but does not declare itself a Callback
        def on_close(self, run: Any) -> None: ...

    with pytest.raises(TypeError, match=r"callbacks\[1\]: expected a cadence.Callback .* got DuckTyped"):
        controller(tmp_path, [Callback(), DuckTyped()])


def test_stop_training_still_ends_training(tmp_path):
    events: list = []

    def stop(metrics):
        raise StopTraining("enough")

    with controller(tmp_path, [Recorder(events)], eval_actions=[stop]) as c:
        c.train_and_evaluate(train_steps=10, eval_interval=2)
    assert events[-2:] == [("train_end", (2, 2)), ("close", "rec")]


# ------------------------------------------------------------------ checkpoint_save


def test_non_chief_is_not_told_about_checkpoints(tmp_path):
    events: list = []
    with controller(tmp_path, [Recorder(events)], coordinator=LocalNonChief()) as c:
        c.train_and_evaluate(train_steps=4, eval_interval=2)
    assert not (tmp_path / "checkpoints" / "ckpt-2").exists()  # the chief writes; this rank did not
    assert [e[0] for e in events] == ["attach", "train_start", "eval_end", "eval_end", "train_end", "close"]


@pytest.mark.parametrize("max_to_keep", [None, 0])
def test_async_save_reports_each_commit_once_on_the_main_thread_after_the_commit(tmp_path, max_to_keep):
    events: list = []
    ckpts = manager(tmp_path, async_save=True, max_to_keep=max_to_keep)
    with controller(tmp_path, [Recorder(events)], checkpoint_manager=ckpts) as c:
        c.train(8)
        saves = [detail for kind, detail in events if kind == "save"]
        # every commit reported before train() returned; each once, committed (and not yet deleted
        # by the next commit's retention, with max_to_keep=0), on the main thread
        assert saves == [(f"ckpt-{s}", True, True) for s in (2, 4, 6, 8)]
        assert events[-1] == ("train_end", (8, 8))


def test_async_save_pending_at_close_is_reported_by_close(tmp_path):
    events: list = []
    c = controller(tmp_path, [Recorder(events)], checkpoint_manager=manager(tmp_path, async_save=True))
    c.train(2, checkpoint_at_completion=False)
    c.save_checkpoint()  # step 2 again: already committed, nothing new
    c.trainer.train(1)
    c.save_checkpoint()  # step 3: in flight now, maybe
    c.close()
    saves = [detail for kind, detail in events if kind == "save"]
    assert saves == [("ckpt-2", True, True), ("ckpt-3", True, True)]
    assert events[-1] == ("close", "rec")


# ------------------------------------------------------------------ checkpoint_load


def test_checkpoint_load_on_resume_and_rollback(tmp_path):
    first: list = []
    with controller(tmp_path, [Recorder(first)]) as c:
        c.train(4)
    assert ("load", "ckpt-4") not in first  # nothing to restore on a fresh start

    events: list = []
    with controller(tmp_path, [Recorder(events)], trainer=RollbackTrainer()) as c:
        assert events == [("attach", None), ("load", "ckpt-4")]  # restored on construction
        c.train(6, checkpoint_at_completion=False)
        assert events[2] == ("train_start", 4)  # the resumed step
        c.rollback()
        assert events[-1] == ("load", "ckpt-6")
        c.restore(4)
        assert events[-1] == ("load", "ckpt-4")


def test_evaluate_continuously_reports_each_restore(tmp_path):
    with controller(tmp_path, []) as c:
        c.train(4)
    events: list = []
    with Controller(evaluator=RestoringEvaluator(FakeTrainer()), checkpoint_manager=manager(tmp_path, writer=False),
                    restore=False,
                    callbacks=[Recorder(events)], progress=False) as c:
        c.evaluate_continuously(mode="every", poll_interval=0.01, timeout=0)
    assert events == [("attach", None), ("load", "ckpt-2"), ("eval_end", (2, 3)),
                      ("load", "ckpt-4"), ("eval_end", (4, 10)), ("close", "rec")]


def test_a_sidecar_tells_its_callbacks_of_each_restore_and_evaluation_and_closes_them(tmp_path):
    from cadence.sidecar.evaluator import SidecarEvaluator

    with controller(tmp_path, []) as c:  # the model dir's checkpoints/: ckpt-2, ckpt-4, FINAL
        c.train(4)
    events: list = []
    SidecarEvaluator(RestoringEvaluator(FakeTrainer()), str(tmp_path), mode="every", poll_interval=0.01,
                     callbacks=[Recorder(events)]).start()
    assert events == [("attach", None), ("load", "ckpt-2"), ("eval_end", (2, 3)),
                      ("load", "ckpt-4"), ("eval_end", (4, 10)), ("close", "rec")]


@pytest.fixture
def restore_sigterm():
    saved = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_preemption_save_and_exit_ends_training_after_the_commit(tmp_path, restore_sigterm):
    from cadence.actions import SaveCheckpointIfPreempted

    events: list = []
    trainer = FakeTrainer(on_step={3: lambda: os.kill(os.getpid(), signal.SIGTERM)})
    ckpts = manager(tmp_path, async_save=True)
    with pytest.raises(SystemExit) as exit_info, controller(
        tmp_path, [Recorder(events)], trainer=trainer, checkpoint_manager=ckpts,
        train_actions=[SaveCheckpointIfPreempted()],
    ) as c:
        c.train_and_evaluate(train_steps=10, eval_interval=2)
    assert exit_info.value.code == 0
    assert events[-3:] == [("save", ("ckpt-4", True, True)), ("train_end", (4, None)), ("close", "rec")]


def test_any_other_system_exit_does_not_end_training(tmp_path):
    events: list = []

    def leave(output):
        raise SystemExit(3)

    with pytest.raises(SystemExit), controller(tmp_path, [Recorder(events)], train_actions=[leave]) as c:
        c.train(10)
    assert [e[0] for e in events] == ["attach", "train_start", "close"]


# ------------------------------------------------------------------ on_close


def test_on_close_after_a_trainer_exception_which_propagates(tmp_path):
    events: list = []

    def boom():
        raise RuntimeError("trainer broke")

    with pytest.raises(RuntimeError, match="trainer broke"), controller(
        tmp_path, [Recorder(events)], trainer=FakeTrainer(on_step={3: boom})
    ) as c:
        c.train_and_evaluate(train_steps=10, eval_interval=2)
    kinds = [e[0] for e in events]
    assert kinds[-1] == "close" and "train_end" not in kinds


def test_on_close_after_an_action_exception_which_propagates(tmp_path):
    events: list = []

    def bad_action(output):
        raise ValueError("action broke")

    with pytest.raises(ValueError, match="action broke"), controller(
        tmp_path, [Recorder(events)], train_actions=[bad_action]
    ) as c:
        c.train(10)
    assert [e[0] for e in events] == ["attach", "train_start", "save", "close"]  # the trained steps committed


class FailingClose(Callback):
    def __init__(self, events: list, name: str) -> None:
        self.events, self.name = events, name

    def on_close(self, run: Any) -> None:
        self.events.append(("close", self.name))
        raise OSError(f"{self.name} could not close")


def test_a_failing_on_close_does_not_stop_the_others_and_the_first_error_is_raised(tmp_path):
    events: list = []
    c = controller(tmp_path, [FailingClose(events, "a"), FailingClose(events, "b"), Recorder(events, "c")])
    with pytest.raises(OSError, match="a could not close"):
        c.close()
    assert events[-3:] == [("close", "a"), ("close", "b"), ("close", "c")]


def test_a_failing_on_close_never_masks_the_exception_in_flight(tmp_path):
    events: list = []
    with pytest.raises(KeyError, match="the real problem"), controller(
        tmp_path, [FailingClose(events, "a"), Recorder(events, "b")]
    ):
        raise KeyError("the real problem")
    assert events[-2:] == [("close", "a"), ("close", "b")]


def test_failed_construction_still_closes_callbacks(tmp_path):
    events: list = []

    class BadAttach(Callback):
        def attach(self, controller):
            raise RuntimeError("cannot attach")

    with pytest.raises(RuntimeError, match="cannot attach"):
        controller(tmp_path, [Recorder(events), BadAttach()])
    assert events == [("attach", None), ("close", "rec")]


# ------------------------------------------------------------------ state


def test_callback_state_is_checkpointed_and_restored_on_resume(tmp_path):
    counter = Counter()
    with controller(tmp_path, [Recorder([]), counter]) as c:
        c.train_and_evaluate(train_steps=4, eval_interval=2)
    assert counter.evaluations == 2
    state = manager(tmp_path, writer=False).read_state(4)["state"]
    assert state["callbacks/1/Counter"] == {"evaluations": 2}
    assert "callbacks/0/Recorder" not in state  # stateless callbacks are not saved

    resumed = Counter()
    with controller(tmp_path, [Recorder([]), resumed]) as c:
        assert resumed.evaluations == 2  # restored on construction
        c.train_and_evaluate(train_steps=8, eval_interval=2)
    assert resumed.evaluations == 4


# ------------------------------------------------------------------ the metadata example


def test_metadata_written_after_the_commit_is_kept_restorable_and_deleted_by_retention(tmp_path):
    with controller(tmp_path, [WriteMetadata()], checkpoint_manager=manager(tmp_path, max_to_keep=2)) as c:
        c.train(6)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-4", "ckpt-6"]
    for step in (4, 6):
        meta = json.loads((ckpts / f"ckpt-{step}" / "metadata.json").read_text())
        assert meta["step"] == step and meta["hostname"] == socket.gethostname()
        reader, _ = manager(tmp_path, writer=False).read(step)  # verification ignores the extra file
        assert "metadata.json" not in reader.names() and MODEL_FILE in reader.names()
    events: list = []
    with controller(tmp_path, [Recorder(events)]) as c:
        assert c.global_step == 6 and c.trainer.value == 21  # restored from the checkpoint with the extra file
    assert events[1] == ("load", "ckpt-6")


# ------------------------------------------------------------------ config


CALLBACK_FILE = '''
from cadence import Callback

class Marker(Callback):
    def __init__(self, label: str = "x") -> None:
        self.label = label
'''


def config_with(tmp_path: Path, callbacks) -> Path:
    path = tmp_path / "conf" / "config.yaml"
    path.parent.mkdir(exist_ok=True)
    (path.parent / "my_callbacks.py").write_text(CALLBACK_FILE)
    path.write_text(yaml.safe_dump({"task": {"class": f"{TESTS / 'tasks.py'}:TinyTask"}, "callbacks": callbacks}))
    return path


def test_config_builds_the_task_callbacks_then_the_configured_ones(tmp_path, monkeypatch):
    from cadence.config import load_config
    from cadence.torch.experiments.callbacks import build_callbacks
    from cadence.torch.experiments.task_loader import build_task

    monkeypatch.chdir(tmp_path)  # a relative file path resolves against the config file's directory
    cfg = load_config(config_with(tmp_path, [
        {"class": "my_callbacks.py:Marker", "params": {"label": "mine"}},
        {"class": "cadence.extensions:Callback"},
    ]))
    assert cfg.callbacks[0].class_path == f"{tmp_path / 'conf' / 'my_callbacks.py'}:Marker"
    assert cfg.to_dict()["callbacks"][0] == {"class": f"{tmp_path / 'conf' / 'my_callbacks.py'}:Marker",
                                             "params": {"label": "mine"}}
    task = build_task(cfg)
    task.build_callbacks = lambda: ["from the task"]
    built = build_callbacks(cfg, task)
    assert built[0] == "from the task"
    assert type(built[1]).__name__ == "Marker" and built[1].label == "mine"
    assert type(built[2]) is Callback


def test_no_callbacks_section_means_none(tmp_path):
    from cadence.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text("task: {class: 'a.b:C'}\ncallbacks:\n")
    assert load_config(path).callbacks == []


@pytest.mark.parametrize("entry, message", [
    ({"class": "no_such_module_xyz:Marker"}, r"callbacks\[0\].class: cannot import module 'no_such_module_xyz'"),
    ({"class": "my_callbacks.py:Missing"}, r"callbacks\[0\].class: module '.*my_callbacks.py' has no class 'Missing'"),
    ({"class": "missing_file.py:Marker"}, r"callbacks\[0\].class: file not found: .*missing_file.py"),
    ({"class": "my_callbacks.py:Marker", "params": {"colour": 1}},
     r"callbacks\[0\].params: Marker\(\*\*params\) failed: .*unexpected keyword argument 'colour'"),
])
def test_bad_callback_specs_name_the_field(tmp_path, entry, message):
    from cadence.config import load_config
    from cadence.torch.experiments.callbacks import build_callbacks
    from cadence.torch.experiments.task_loader import build_task

    cfg = load_config(config_with(tmp_path, [entry]))
    with pytest.raises(ConfigError, match=message):
        build_callbacks(cfg, build_task(cfg))


def test_malformed_callback_entries_are_config_errors(tmp_path):
    from cadence.config import load_config

    path = config_with(tmp_path, [{"clas": "a:B"}])
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.clas: unknown field \(did you mean 'class'\?\)"):
        load_config(path)
    path = config_with(tmp_path, [{"class": "not a spec"}])
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.class: expected 'module:ClassName'"):
        load_config(path)


# ------------------------------------------------------------------ SIGTERM in `cadence train`


def start_training(tmp_path: Path, save_on_preemption: bool) -> tuple[subprocess.Popen, Path]:
    events = tmp_path / "events.jsonl"
    cfg = {
        "task": {"class": f"{TESTS / 'callback_tasks.py'}:TaskWithCallbacks",
                 "params": {"events": str(events), "step_sleep": 0.02}},
        "trainer": {"train_steps": 100000, "steps_per_loop": 5, "checkpoint_interval": 5,
                    "save_on_preemption": save_on_preemption, "device": "cpu"},
        "callbacks": [{"class": f"{TESTS / 'callback_tasks.py'}:EventLog", "params": {"path": str(events)}}],
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = popen(
        ["-m", "cadence", "train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Wait until both logs (the task's, then the config's) have seen a commit: the task's callback runs
    # first, so its line alone does not mean the config's has been written yet.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if events.exists() and all("checkpoint_save" in read_events(events, tag) for tag in ("task", "config")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    return proc, events


def read_events(path: Path, tag: str) -> list[str]:
    """The events logged under ``tag``, from complete lines only (the process may be mid-write)."""
    lines = path.read_text().split("\n")[:-1]
    return [e["event"] for e in map(json.loads, lines) if e["tag"] == tag]


def test_sigterm_with_save_on_preemption_saves_ends_training_and_closes(tmp_path):
    proc, events = start_training(tmp_path, save_on_preemption=True)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    for tag in ("task", "config"):
        seen = read_events(events, tag)
        assert seen[:2] == ["attach", "train_start"]
        assert seen[-3:] == ["checkpoint_save", "train_end", "close"]  # the preemption checkpoint, then the end
        assert "eval_end" not in seen
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["tag"] for r in rows if r["event"] == "close"] == ["task", "config"]  # the task's first
    assert all(r["manifest"] for r in rows if r["event"] == "checkpoint_save")
    last_save = [r["dir"] for r in rows if r["event"] == "checkpoint_save"][-1]
    assert (tmp_path / "run" / "checkpoints" / last_save / "MANIFEST.json").exists()


def test_sigterm_without_save_on_preemption_closes_and_exits_non_zero(tmp_path):
    proc, events = start_training(tmp_path, save_on_preemption=False)
    saved_before = read_events(events, "config").count("checkpoint_save")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    for tag in ("task", "config"):
        seen = read_events(events, tag)
        assert seen[-1] == "close"
        assert "train_end" not in seen
    assert "received SIGTERM" in stderr
    assert saved_before >= 1


# ------------------------------------------------------------------ per-step hooks


class Stepper(Callback):
    """Records ``(step, run)`` after each optimizer step."""

    def __init__(self, events: list) -> None:
        self.events = events

    def on_train_step_end(self, run: Any, step: int) -> None:
        self.events.append(("step", step, run))


def test_per_step_callbacks_are_called_after_each_step_with_the_run(tmp_path):
    from fakes import SteppingTrainer

    events: list = []
    trainer = SteppingTrainer()
    with controller(tmp_path, [Stepper(events), Recorder([]), Stepper(events)], trainer=trainer) as c:
        c.train(3)
    assert [(kind, step) for kind, step, _ in events] == [("step", 1), ("step", 1), ("step", 2), ("step", 2),
                                                         ("step", 3), ("step", 3)]
    assert all(run is c for _, _, run in events)


def test_without_a_per_step_callback_the_trainer_is_handed_nothing(tmp_path):
    from fakes import SteppingTrainer

    trainer = SteppingTrainer()
    trainer.step_end = lambda step: None  # from an earlier controller: replaced
    with controller(tmp_path, [Recorder([])], trainer=trainer) as c:
        c.train(2)
    assert trainer.step_end is None and trainer.on_step_end_calls == 1


def test_a_per_step_callback_needs_a_trainer_that_reports_steps(tmp_path):
    with pytest.raises(TypeError, match=r"callbacks \['Stepper'\] override on_train_step_end, and the trainer "
                                        r"\(FakeTrainer\) cannot report steps: .*ReportsSteps"):
        controller(tmp_path, [Recorder([]), Stepper([])])
    # an evaluator-only run trains nothing: its per-step callbacks are never called, and allowed
    trainer = FakeTrainer()
    Controller(evaluator=FakeEvaluator(trainer), callbacks=[Stepper([])], progress=False).close()
