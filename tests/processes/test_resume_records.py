"""What a resumed run records (issue 12, item 8): a model dir trained past ``train_steps`` trains,
evaluates and rewrites nothing; a run killed after a summary past its last checkpoint drops those
records on resume, from ``metrics.jsonl`` and (through TensorBoard's restart marker) from the
events, so each step is recorded once -- checked with tensorboard's own reader."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cadence import Controller
from cadence.checkpoint import CheckpointManager
from cadence.storage import Storage
from cadence.summaries.manager import SummaryManager
from cadence.summaries.metrics_file import read_metrics, truncate_metrics
from cli_run import popen, run_cadence
from fakes import FakeTrainer
from configs import write_config as tiny_config

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:TinyTask"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def steps_of(path) -> list[int]:
    return [r["step"] for r in read_metrics(path)]


def tensorboard_steps(logdir: Path, tag: str) -> list[int]:
    """The steps TensorBoard shows for ``tag`` (its reader, discarding orphaned data as it does)."""
    acc = EventAccumulator(str(logdir), purge_orphaned_data=True)
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]


def tensorboard_values(logdir: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(logdir), purge_orphaned_data=True)
    acc.Reload()
    return {event.step: event.value for event in acc.Scalars(tag)}


# ------------------------------------------------------------------ truncating metrics.jsonl

LINES = [b'{"step": 5, "time": 1.0, "loss": 0.5}\n',
         b'not json: kept as it is\n',
         b'{"step": 10, "time": 2.0, "loss": NaN}\n',
         b'{"note": "no step"}\n',
         b'{"step": 15, "time": 3.0, "loss": 0.25}\n',
         b'{"step": 20, "time": 4.0, "loss": 0.125}\n']


@pytest.mark.parametrize("store", ["local", "memory"])
def test_truncate_metrics_drops_the_records_past_a_step_and_keeps_the_rest_byte_for_byte(tmp_path, store):
    directory = str(tmp_path) if store == "local" else f"memory://{tmp_path.name}-{store}/train"
    storage = Storage(directory)
    storage.makedirs(storage.root)
    path = storage.join("metrics.jsonl")
    storage.write_bytes(path, b"".join(LINES) + b'{"step": 25, "ti')  # a killed writer's partial line

    assert truncate_metrics(directory, 10) == 2
    assert storage.read_bytes(path) == b"".join(LINES[:4])
    assert truncate_metrics(storage.url(path), 10) == 0  # the file itself; nothing more to drop
    assert truncate_metrics(directory, 0) == 2
    assert storage.read_bytes(path) == LINES[1] + LINES[3]  # lines without a step stay
    assert storage.listdir(storage.root) == ["metrics.jsonl"]  # no temp file left behind
    assert truncate_metrics(f"{directory}/missing", 3) == 0  # nothing there: nothing written
    assert not storage.exists(storage.join("missing"))


def test_truncate_metrics_replaces_the_file_at_once_and_only_when_it_changes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(LINES))
    inode = path.stat().st_ino
    assert truncate_metrics(tmp_path, 20) == 0
    assert path.stat().st_ino == inode  # untouched
    assert truncate_metrics(tmp_path, 12) == 2
    assert path.stat().st_ino != inode  # a new file renamed over the old one: never seen half-written
    assert path.read_bytes() == b"".join(LINES[:4])


# ------------------------------------------------------------------ the summary manager on resume


def write_run(directory: Path, steps, offset: float = 0.0) -> None:
    manager = SummaryManager(str(directory))
    for step in steps:
        manager.write_summaries(step, {"loss": step + offset, "ds": {"accuracy": step / 100 + offset}})
    manager.flush()
    manager.close()


def test_resume_at_drops_the_records_and_events_past_the_restored_step(tmp_path):
    write_run(tmp_path, [5, 10, 15, 20, 25, 30])  # a run killed at 30; its checkpoint is at 20
    time.sleep(1.1)  # event files are named after the second they were opened in
    manager = SummaryManager(str(tmp_path))
    manager.resume_at(20)
    assert steps_of(tmp_path) == [5, 10, 15, 20]  # at once, before any write
    for step in (25, 30, 35):
        manager.write_summaries(step, {"loss": step + 0.5, "ds": {"accuracy": step / 100 + 0.5}})
    manager.close()
    manager.write_summaries(40, {"loss": 40.5, "ds": {"accuracy": 0.9}})  # reopened writers do not purge again
    manager.close()

    expected = [5, 10, 15, 20, 25, 30, 35, 40]
    assert steps_of(tmp_path) == expected
    assert tensorboard_steps(tmp_path, "loss") == expected
    assert tensorboard_steps(tmp_path / "ds", "accuracy") == expected  # a dataset's subdirectory too
    values = tensorboard_values(tmp_path, "loss")
    assert values[20] == 20.0 and values[25] == 25.5  # the old run's up to 20, the resumed run's after


def test_resume_at_writes_no_marker_where_there_are_no_events_and_nothing_when_disabled(tmp_path):
    manager = SummaryManager(str(tmp_path / "fresh"))
    manager.resume_at(0)
    manager.write_summaries(5, {"loss": 1.0})
    manager.close()
    assert tensorboard_steps(tmp_path / "fresh", "loss") == [5]

    write_run(tmp_path / "other", [5, 10])
    SummaryManager(str(tmp_path / "other"), enabled=False).resume_at(5)  # not the chief
    assert steps_of(tmp_path / "other") == [5, 10]


# ------------------------------------------------------------------ the controller on resume


class FakeEvaluator:
    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer
        self.calls: list[int] = []

    def evaluate(self, num_steps: int):
        self.calls.append(self.trainer.step)
        return {"accuracy": self.trainer.step / 100}


def controller(tmp_path: Path, trainer: FakeTrainer, evaluator: FakeEvaluator | None = None,
               progress: bool = False) -> Controller:
    return Controller(trainer=trainer, evaluator=evaluator, steps_per_loop=5, checkpoint_interval=10,
                      checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints")),
                      summary_dir=str(tmp_path / "train"), eval_summary_dir=str(tmp_path / "eval"),
                      progress=progress)


def test_a_resumed_controller_records_each_step_once(tmp_path):
    t = FakeTrainer(on_step={16: lambda: (_ for _ in ()).throw(KeyboardInterrupt())})  # "killed" in step 16
    with pytest.raises(KeyboardInterrupt), controller(tmp_path, t, FakeEvaluator(t)) as c:
        c.train_and_evaluate(train_steps=30, eval_interval=5)
    assert steps_of(tmp_path / "train") == [5, 10, 15] and steps_of(tmp_path / "eval") == [5, 10, 15]
    time.sleep(1.1)  # event files are named after the second they were opened in
    t2 = FakeTrainer()
    with controller(tmp_path, t2, FakeEvaluator(t2)) as c:  # restores ckpt-10
        assert steps_of(tmp_path / "train") == [5, 10] and steps_of(tmp_path / "eval") == [5, 10]
        c.train_and_evaluate(train_steps=30, eval_interval=5)
    assert steps_of(tmp_path / "train") == [5, 10, 15, 20, 25, 30]
    assert steps_of(tmp_path / "eval") == [5, 10, 15, 20, 25, 30]
    assert tensorboard_steps(tmp_path / "train", "loss") == [5, 10, 15, 20, 25, 30]


def test_only_a_training_controller_that_evaluates_drops_eval_records(tmp_path):
    controller(tmp_path, FakeTrainer()).train(10)
    write_run(tmp_path / "train", [15])  # a killed run's, past ckpt-10
    write_run(tmp_path / "eval", [10, 20])  # e.g. a sidecar's
    controller(tmp_path, FakeTrainer())  # no evaluator: the eval records are not its own
    assert steps_of(tmp_path / "train") == [5, 10] and steps_of(tmp_path / "eval") == [10, 20]
    evaluator_only = Controller(evaluator=FakeEvaluator(FakeTrainer()),
                                checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints"), writer=False),
                                eval_summary_dir=str(tmp_path / "eval"), progress=False)
    assert evaluator_only.restored_step == 10 and steps_of(tmp_path / "eval") == [10, 20]


def test_a_run_past_its_train_steps_trains_and_evaluates_nothing(tmp_path, caplog, capsys):
    t = FakeTrainer()
    controller(tmp_path, t, FakeEvaluator(t)).train_and_evaluate(train_steps=20, eval_interval=10)
    t2 = FakeTrainer()
    ev2 = FakeEvaluator(t2)
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="cadence"):
        out = controller(tmp_path, t2, ev2, progress=True).train_and_evaluate(train_steps=10, eval_interval=10)
    assert "20/10" not in capsys.readouterr().err  # no progress line
    assert t2.requests == [] and ev2.calls == []
    assert out == {"accuracy": 0.2}  # the evaluation at 20, as recorded
    assert steps_of(tmp_path / "eval") == [10, 20]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the model dir has trained to step 20, past train_steps=10: nothing to train"]
    assert json.loads((tmp_path / "checkpoints" / "FINAL").read_text())["step"] == 20


# ------------------------------------------------------------------ as a user runs it


def write_config(directory: Path, **trainer) -> Path:
    params = {"step_sleep": trainer.pop("step_sleep", 0.0)}
    return tiny_config(directory, TASK, params=params, trainer={
        "train_steps": 40, "steps_per_loop": 5, "checkpoint_interval": 20, "validation_interval": 20,
        "max_to_keep": 3, "seed": 3, **trainer})


def cadence_train(config: Path, model_dir: Path, *args: str, progress: bool = False) -> subprocess.CompletedProcess:
    return run_cadence("train", str(config), "--model-dir", str(model_dir), *args, *([] if progress else ["--no-progress"]))


def test_cadence_train_with_a_lower_train_steps_warns_and_changes_nothing(tmp_path):
    config, run = write_config(tmp_path / "cfg"), tmp_path / "run"
    first = cadence_train(config, run)
    assert first.returncode == 0, first.stderr
    saved = {name: (run / name).read_bytes() for name in ("config.yaml", "eval/metrics.jsonl", "checkpoints/FINAL")}
    assert steps_of(run / "eval") == [20, 40]

    again = cadence_train(config, run, "--set", "trainer.train_steps=20", progress=True)  # progress lines on
    assert again.returncode == 0, again.stderr
    output = " ".join((again.stdout + again.stderr).split())
    assert "the model dir has trained to step 40, past train_steps=20: nothing to train" in output
    assert "40/20" not in output and "eval at step" not in output
    for name, content in saved.items():
        assert (run / name).read_bytes() == content, name  # config.yaml still says 40, as FINAL does (its time too)
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 40
    assert tensorboard_steps(run / "eval", "accuracy") == [20, 40]


def test_a_run_killed_after_a_summary_past_its_checkpoint_records_each_step_once(tmp_path):
    settings = {"train_steps": 60, "summary_interval": 5, "checkpoint_interval": 20, "validation_interval": 10}
    straight = tmp_path / "straight"
    done = cadence_train(write_config(tmp_path / "a", **settings), straight)
    assert done.returncode == 0, done.stderr

    config, run = write_config(tmp_path / "b", step_sleep=0.1, **settings), tmp_path / "run"
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(run),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    try:
        while True:  # until both the train and the eval summaries are past the latest checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            latest = CheckpointManager(str(run / "checkpoints"), writer=False).latest_step()
            if latest is not None and max(steps_of(run / "train"), default=0) > latest \
                    and max(steps_of(run / "eval"), default=0) > latest:
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    restored = CheckpointManager(str(run / "checkpoints"), writer=False).latest_step()
    killed_train, killed_eval = steps_of(run / "train"), steps_of(run / "eval")
    assert max(killed_train) > restored and max(killed_eval) > restored, (restored, killed_train, killed_eval)

    time.sleep(1.1)  # event files are named after the second they were opened in
    resumed = cadence_train(config, run, "--set", "task.params.step_sleep=0")
    assert resumed.returncode == 0, resumed.stderr
    for name, tag in (("train", "loss"), ("eval", "accuracy")):
        steps = steps_of(run / name)
        assert steps == sorted(set(steps)), (name, steps)  # strictly increasing: no step twice
        assert steps == steps_of(straight / name), name
        assert tensorboard_steps(run / name, tag) == steps, name
        # exact resume: the records after the restart are the uninterrupted run's
        assert tensorboard_values(run / name, tag) == tensorboard_values(straight / name, tag), name
