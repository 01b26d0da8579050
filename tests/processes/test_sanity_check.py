"""An error at the first evaluation must not lose the training before it (issue 12, item 6).

The sanity check (``trainer.sanity_val_steps`` validation batches before training, then the eval
actions' :class:`~cadence.extensions.ChecksOutputs` checks) fails bad validation code or a
misnamed metric before any step; an error of an evaluation or an action after training steps
commits them first. With fakes (no torch) for the controller, then through the CLI.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from cadence import Controller
from cadence.actions import BestCheckpointExporter, ConditionalAction, EarlyStopping, NewBestMetric
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.session import CheckpointSession
from cadence.runtime.coordination import LocalCoordinator
from cadence.errors import (CheckpointError, ConfigError, SanityCheckError, TrainingDivergedError,
                            ValidationOutputError)
from cadence.extensions import ChecksOutputs
from cadence.loop.sanity import sanity_check
from cadence.summaries.metrics_file import read_metrics
from cli_run import run_cadence as cadence
from fakes import MODEL_FILE, FakeTrainer

TASKS = Path(__file__).parents[1] / "sanity_tasks.py"


class FakeEvaluator:
    """Metrics of the trainer's step; ``fail`` (step -> exception) raises at that step."""

    def __init__(self, trainer: FakeTrainer, fail: dict[int, Exception] | None = None,
                 metrics: dict | None = None) -> None:
        self.trainer = trainer
        self.fail = dict(fail or {})
        self.metrics = metrics
        self.calls: list[tuple[int, int]] = []

    def evaluate(self, num_steps: int):
        self.calls.append((self.trainer.step, num_steps))
        error = self.fail.pop(self.trainer.step, None)
        if error is not None:
            raise error
        return dict(self.metrics) if self.metrics is not None else {"accuracy": float(self.trainer.step)}


class Raise:
    """An action raising ``error`` at the steps of ``at``."""

    def __init__(self, trainer: FakeTrainer, error: Exception, at: set[int]) -> None:
        self.trainer, self.error, self.at = trainer, error, set(at)

    def __call__(self, output) -> None:
        if self.trainer.step in self.at:
            self.at.discard(self.trainer.step)
            raise self.error


def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"))


def controller(tmp_path: Path, trainer: FakeTrainer, evaluator=None, **kw) -> Controller:
    kw.setdefault("checkpoint_interval", 20)
    return Controller(trainer=trainer, evaluator=evaluator, checkpoint_manager=manager(tmp_path), steps_per_loop=5,
                      summary_dir=str(tmp_path / "train"), eval_summary_dir=str(tmp_path / "eval"), progress=False,
                      **kw)


def state_at(tmp_path: Path, step: int) -> dict:
    return manager(tmp_path).read_state(step)["state"]


def model_at(tmp_path: Path, step: int) -> dict:
    reader, _ = manager(tmp_path).read(step)
    return json.loads(reader.read(MODEL_FILE))


# ------------------------------------------------------------------ the sanity check


def test_the_eval_actions_that_read_a_metric_declare_the_check():
    best = NewBestMetric("accuracy")
    assert isinstance(best, ChecksOutputs)
    assert isinstance(EarlyStopping("accuracy", patience=1), ChecksOutputs)
    assert isinstance(BestCheckpointExporter.__new__(BestCheckpointExporter), ChecksOutputs)
    best.check_outputs({"accuracy": 1.0, "loss": 0.5})  # there: nothing raised
    with pytest.raises(ConfigError, match=r"NewBestMetric: metric 'acc' is not in the evaluation outputs; "
                                          r"available: 'accuracy', 'loss'"):
        NewBestMetric("acc").check_outputs({"loss": 0.5, "accuracy": 1.0})
    with pytest.raises(ConfigError, match=r"EarlyStopping: metric 'a/b' cannot be read as a number"):
        EarlyStopping("a/b", patience=1).check_outputs({"a": {"b": "text"}})


def test_a_misnamed_metric_fails_the_sanity_check_before_any_step(tmp_path):
    trainer = FakeTrainer()
    evaluator = FakeEvaluator(trainer, metrics={"accuracy": 1.0, "loss": 0.5})
    early = EarlyStopping("acc", patience=2)
    c = controller(tmp_path, trainer, evaluator, eval_actions=[early])
    with pytest.raises(SanityCheckError) as failed:
        c.train_and_evaluate(train_steps=20, eval_interval=10, sanity_steps=2)
    message = str(failed.value)
    assert "\n" not in message and failed.value.exit_code == 2
    assert "sanity check (2 validation batches before training)" in message
    assert "EarlyStopping: metric 'acc' is not in the evaluation outputs; available: 'accuracy', 'loss'" in message
    assert evaluator.calls == [(0, 2)] and trainer.requests == []  # nothing trained
    assert not (tmp_path / "eval").exists() and not (tmp_path / "train").exists()  # nothing written
    assert manager(tmp_path).steps() == []


def test_the_sanity_check_finds_an_action_wrapped_in_another(tmp_path):
    trainer = FakeTrainer()
    best = NewBestMetric("acc")
    with pytest.raises(SanityCheckError, match=r"NewBestMetric: metric 'acc'"):
        sanity_check(FakeEvaluator(trainer), [ConditionalAction(best.test, [lambda out: None, best.commit])], 1)


def test_a_wrong_output_type_fails_the_sanity_check_in_one_line(tmp_path):
    class Wrong:
        def evaluate(self, num_steps):
            raise ValidationOutputError("MyTask.validation_step returned float 0.5; expected a dict of metrics")

    with pytest.raises(SanityCheckError, match=r"^sanity check \(1 validation batch before training\): "
                                               r"MyTask\.validation_step returned float 0\.5; expected a dict"):
        sanity_check(Wrong(), [], 1)


def test_a_passing_sanity_check_changes_nothing(tmp_path):
    """Same evaluations, summaries, checkpoints and actions' state as without the check."""

    def run(where: Path, sanity_steps: int) -> tuple[list, list, dict]:
        trainer = FakeTrainer()
        evaluator = FakeEvaluator(trainer)
        early = EarlyStopping("accuracy", patience=3)
        c = controller(where, trainer, evaluator, eval_actions=[early])
        c.train_and_evaluate(train_steps=40, eval_interval=10, sanity_steps=sanity_steps)
        c.close()
        metrics = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(where / "eval")]
        return evaluator.calls, metrics, state_at(where, 40)

    calls, metrics, state = run(tmp_path / "with", 2)
    assert calls[0] == (0, 2) and calls[1:] == run(tmp_path / "without", 0)[0]
    assert (metrics, state) == run(tmp_path / "without2", 0)[1:]


def test_sanity_steps_must_be_at_least_one():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        sanity_check(FakeEvaluator(FakeTrainer()), [], 0)


# ------------------------------------------------------------------ commit before an error propagates


def test_an_evaluation_error_commits_the_trained_steps_first_and_resume_is_exact(tmp_path):
    trainer = FakeTrainer()
    c = controller(tmp_path, trainer, FakeEvaluator(trainer, fail={30: RuntimeError("eval broke")}))
    with pytest.raises(RuntimeError, match="eval broke"):
        c.train_and_evaluate(train_steps=60, eval_interval=10)
    c.close()
    assert manager(tmp_path).steps() == [20, 30]  # 30 is past the interval checkpoints: saved for the error
    assert model_at(tmp_path, 30) == {"step": 30, "value": sum(range(31))}
    assert state_at(tmp_path, 30)["controller"] == {"last_eval_step": 20}  # the evaluation at 30 never ran

    resumed_trainer = FakeTrainer()
    evaluator = FakeEvaluator(resumed_trainer)
    resumed = controller(tmp_path, resumed_trainer, evaluator)
    assert resumed.restored_step == 30
    resumed.train_and_evaluate(train_steps=60, eval_interval=10)
    resumed.close()
    assert evaluator.calls[0] == (30, -1)  # the failed evaluation runs again first

    straight = FakeTrainer()
    c = controller(tmp_path / "straight", straight, FakeEvaluator(straight))
    c.train_and_evaluate(train_steps=60, eval_interval=10)
    c.close()
    assert model_at(tmp_path, 60) == model_at(tmp_path / "straight", 60)


def test_an_eval_action_error_saves_the_state_from_before_the_evaluation(tmp_path):
    """EarlyStopping ran before the failing action: the checkpoint holds its state before the
    evaluation, so that the evaluation run again on resume counts once."""
    trainer = FakeTrainer()
    early = EarlyStopping("accuracy", patience=5, higher_is_better=False)  # accuracy = step: never improves
    c = controller(tmp_path, trainer, FakeEvaluator(trainer),
                   eval_actions=[early, Raise(trainer, KeyError("no such metric"), at={30})])
    with pytest.raises(KeyError):
        c.train_and_evaluate(train_steps=60, eval_interval=10)
    c.close()
    assert early.wait == 2  # in memory, the evaluation at 30 counted
    state = state_at(tmp_path, 30)
    assert state["eval_actions/0/EarlyStopping"]["wait"] == 1  # as after the evaluation at 20
    assert state["controller"] == {"last_eval_step": 20}


def test_a_train_action_error_commits_the_trained_steps(tmp_path):
    trainer = FakeTrainer()
    c = controller(tmp_path, trainer, train_actions=[Raise(trainer, ValueError("action broke"), at={15})])
    with pytest.raises(ValueError, match="action broke"):
        c.train(40)
    c.close()
    assert manager(tmp_path).steps() == [15]
    assert model_at(tmp_path, 15) == {"step": 15, "value": sum(range(16))}


@pytest.mark.parametrize("error", [CheckpointError("disk full"), TrainingDivergedError("loss nan")])
def test_no_commit_for_a_checkpoint_failure_or_a_diverged_state(tmp_path, error):
    trainer = FakeTrainer()
    c = controller(tmp_path, trainer, train_actions=[Raise(trainer, error, at={15})])
    with pytest.raises(type(error)):
        c.train(40)
    c.close()
    assert manager(tmp_path).steps() == []


def test_no_commit_for_an_error_inside_a_training_step(tmp_path):
    """The trainer's state is mid-step then (data and RNG past the failing batch)."""

    def broken() -> None:
        raise RuntimeError("train_step broke")

    trainer = FakeTrainer(on_step={13: broken})
    c = controller(tmp_path, trainer)
    with pytest.raises(RuntimeError, match="train_step broke"):
        c.train(40)
    c.close()
    assert manager(tmp_path).steps() == []


def test_no_commit_when_nothing_was_trained_since_the_last_checkpoint(tmp_path):
    trainer = FakeTrainer()
    c = controller(tmp_path, trainer, FakeEvaluator(trainer, fail={20: RuntimeError("eval broke")}),
                   checkpoint_interval=10)
    with pytest.raises(RuntimeError):
        c.train_and_evaluate(train_steps=40, eval_interval=20)
    c.close()
    assert manager(tmp_path).steps() == [10, 20]  # 20: the save due after the evaluation, made for the error
    assert state_at(tmp_path, 20)["controller"] == {"last_eval_step": None}
    committed = (tmp_path / "checkpoints" / "ckpt-20" / "MANIFEST.json").read_bytes()
    trainer = FakeTrainer()
    evaluator = FakeEvaluator(trainer, fail={20: RuntimeError("eval broke again")})
    c = controller(tmp_path, trainer, evaluator, checkpoint_interval=10)
    with pytest.raises(RuntimeError, match="again"):
        c.train_and_evaluate(train_steps=40, eval_interval=20)  # evaluates the restored step 20 first
    c.close()
    assert evaluator.calls == [(20, -1)] and trainer.requests == []
    assert manager(tmp_path).steps() == [10, 20]
    assert (tmp_path / "checkpoints" / "ckpt-20" / "MANIFEST.json").read_bytes() == committed  # not saved again


def test_a_failing_commit_is_logged_and_the_error_propagates(tmp_path, caplog):
    class Unsavable(FakeTrainer):
        def save_checkpoint(self, writer):
            raise OSError("read-only file system")

    trainer = Unsavable()
    c = controller(tmp_path, trainer, train_actions=[Raise(trainer, ValueError("action broke"), at={15})])
    with pytest.raises(ValueError, match="action broke"):
        c.train(40)
    assert "committing that step failed too" in caplog.text


class TwoRanks(LocalCoordinator):
    world_size = 2


def test_no_commit_on_error_in_a_multi_process_run(tmp_path):
    """A save is a collective: an error raised on one rank only would leave the others waiting."""
    session = CheckpointSession(manager(tmp_path), TwoRanks(), on_save=lambda p: None, on_load=lambda p: None)
    assert not session.commits_on_error
    trainer = FakeTrainer()
    trainer.train(5)
    with pytest.raises(RuntimeError):
        with session.commit_on_error(lambda: 5, lambda: {"trainer": trainer}, lambda: None, "an action"):
            raise RuntimeError("only here")
    assert manager(tmp_path).steps() == []


# ------------------------------------------------------------------ through the CLI


def write_config(tmp_path: Path, task: str, **trainer) -> Path:
    params = trainer.pop("params", {})
    cfg = {"task": {"class": f"{TASKS}:{task}", "params": params},
           "trainer": {"train_steps": 40, "steps_per_loop": 5, "checkpoint_interval": 15,
                       "validation_interval": 10, "seed": 3, **trainer}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress", *extra)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cadence:")]


def checkpoints(model_dir: Path) -> list[str]:
    directory = model_dir / "checkpoints"
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.parametrize("task, returned", [("FloatValidationTask", "returned float "),
                                            ("ListValidationTask", "returned a list of 2 item(s)")])
def test_cli_a_validation_step_of_the_wrong_type_exits_2_before_training(tmp_path, task, returned):
    run = tmp_path / "run"
    proc = train(write_config(tmp_path, task), run)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = error_lines(proc.stderr)
    assert line.startswith("cadence: error: sanity check (2 validation batches before training): ")
    assert f"{task}.validation_step {returned}" in line and "expected a dict of metrics" in line
    assert checkpoints(run) == [] and not (run / "train").exists()


def test_cli_a_best_checkpoint_metric_not_in_the_outputs_exits_2_before_training(tmp_path):
    run = tmp_path / "run"
    proc = train(write_config(tmp_path, "FlakyValidationTask", best_checkpoint={"metric": "acc"}), run)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = error_lines(proc.stderr)
    assert ("BestCheckpointExporter: metric 'acc' is not in the evaluation outputs; available: 'accuracy', 'loss'"
            in line)
    assert checkpoints(run) == [] and not list((run / "best").glob("ckpt-*"))


def test_cli_without_the_sanity_check_the_first_evaluation_fails_after_committing_its_step(tmp_path):
    run = tmp_path / "run"
    proc = train(write_config(tmp_path, "FloatValidationTask", checkpoint_interval=None, sanity_val_steps=0), run)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = error_lines(proc.stderr)
    assert line.startswith("cadence: failed: FloatValidationTask.validation_step returned float ")
    assert checkpoints(run) == ["ckpt-10"]  # no interval checkpoints: the error's commit
    verify = cadence("ls", str(run), "--verify")
    assert verify.returncode == 0 and "verified" in verify.stdout, verify.stdout + verify.stderr


def test_cli_an_evaluation_error_at_step_20_commits_it_and_resuming_is_bit_identical(tmp_path):
    """Checkpoints every 15 steps, evaluations every 10: the third pass over the validation data
    (sanity check, step 10, step 20) raises; step 20 is committed before the error propagates."""
    straight = tmp_path / "straight"
    straight.mkdir()
    assert train(write_config(straight, "FlakyValidationTask"), straight / "run").returncode == 0

    run = tmp_path / "run"
    proc = train(write_config(tmp_path, "FlakyValidationTask", params={"fail_at_pass": 3}), run)
    assert proc.returncode == 1, proc.stderr
    assert "validation broke at pass 3" in proc.stderr
    assert checkpoints(run) == ["ckpt-15", "ckpt-20"]
    resumed = train(write_config(tmp_path, "FlakyValidationTask"), run)  # the bug fixed
    assert resumed.returncode == 0, resumed.stderr
    assert "restored" in resumed.stderr or "ckpt-20" in resumed.stderr
    final = "checkpoints/ckpt-40/model.safetensors"
    assert (run / final).read_bytes() == (straight / "run" / final).read_bytes()
    assert [r["step"] for r in read_metrics(run / "eval")][-3:] == [20, 30, 40]
