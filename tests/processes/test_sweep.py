"""``cadence sweep`` (hyperparameter searches on Optuna): the space file and its errors, the pruning
actions against a real sqlite study and the real Controller, and end-to-end sweeps of the digits
example run as a user does -- pruning, a crashing trial, ``cadence ls`` / ``report``, the best
link, a ``kill -9`` of the sweep then its resume, and a sidecar that prunes."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from cadence import Controller  # noqa: E402
from cadence.checkpoint import CheckpointManager  # noqa: E402
from cadence.config import load_config  # noqa: E402
from cadence.config.schema import PrunerConfig, SweepTrialConfig  # noqa: E402
from cadence.errors import CadenceError, ConfigError, StopTraining  # noqa: E402
from cadence.sweep.best_link import point_best  # noqa: E402
from cadence.sweep.listing import format_sweep_table  # noqa: E402
from cadence.sweep.pruning import (OptunaTrial, PruneDecision, ReportToTrial, StopWhenPruned,  # noqa: E402
                                   read_decision, write_decision)
from cadence.sweep.space import check_against_config, distributions, load_space  # noqa: E402
from cadence.sweep.study import SweepDir, SweepLock  # noqa: E402
from cli_run import ROOT, checkpoint_weights, popen, run_cadence, run_python, same_weights  # noqa: E402
from fakes import FakeTrainer  # noqa: E402

DIGITS = str(ROOT / "examples" / "digits" / "config.yaml")
FAST = ["--set", "trainer.steps_per_loop=50", "--set", "trainer.validation_interval=50",
        "--set", "trainer.checkpoint_interval=50", "--set", "export.formats=[safetensors]",
        "--set", "trainer.sanity_val_steps=1"]
"""The digits example made fast: an evaluation (a report to the pruner) and a checkpoint every 50 steps,
only the safetensors export."""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The one ``cadence: error:`` line of a run refused as bad input (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cadence: error:"), proc.stderr
    return lines[0]


# -- the space file -------------------------------------------------------------------------------


def test_space_file_gives_optuna_distributions(tmp_path):
    space = load_space(write(tmp_path / "space.yaml", """
params:
  task.params.lr: {type: float, low: 1e-4, high: 0.1, log: true}
  task.params.hidden: {type: int, low: 16, high: 64, step: 16}
  trainer.grad_clip_norm: {type: float, low: 0.5, high: 2.0, step: 0.5}
  task.params.dropout: {type: categorical, choices: [0.0, 0.1, null]}
sampler: random
seed: 7
direction: minimize
metric: loss
pruner: {kind: hyperband, min_resource: 50, max_resource: 600, reduction_factor: 2}
"""))
    d = distributions(space)
    assert d["task.params.lr"] == optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    assert d["task.params.hidden"] == optuna.distributions.IntDistribution(16, 64, step=16)
    assert d["trainer.grad_clip_norm"] == optuna.distributions.FloatDistribution(0.5, 2.0, step=0.5)
    assert d["task.params.dropout"] == optuna.distributions.CategoricalDistribution([0.0, 0.1, None])
    assert (space.sampler, space.seed, space.direction, space.metric) == ("random", 7, "minimize", "loss")
    assert (space.pruner.kind, space.pruner.max_resource, space.pruner.reduction_factor) == ("hyperband", 600, 2)
    base = load_config(DIGITS)
    check_against_config(space, base, "space.yaml")  # every key is a config key, every end keeps it valid


@pytest.mark.parametrize(("text", "expected"), [
    ("params: {a.b: {type: float, low: 1, high: 0}}", "params.a.b: low (1) is above high (0) (line 1)"),
    ("params:\n  lr: {type: float, low: 0, high: 1, log: true}", "params.lr: log: true needs low > 0, got 0 (line 2)"),
    ("params: {x: {type: categorical}}", "params.x: a categorical parameter needs choices"),
    ("params: {x: {type: categorical, choices: [1], low: 0}}", "a categorical parameter takes choices, not low"),
    ("params: {x: {type: int, low: 1, high: 5.5}}", "params.x: an int parameter needs integer low, high and step"),
    ("params: {x: {type: float, low: 1, high: 2, log: true, step: 0.1}}", "log: true and step exclude each other"),
    ("params: {x: {type: uniform, low: 1, high: 2}}", "params.x.type: input should be 'float', 'int' or 'categorical'"),
    ("params: {}", "params: dictionary should have at least 1 item"),
    ("params: {x: {type: int, low: 1, high: 2}}\nsampler: grid", "sampler: input should be 'tpe' or 'random'"),
    ("params: {x: {type: int, low: 1, high: 2}}\nsamplr: tpe", "samplr: unknown field (line 2)"),
    ("params: {x: {type: int, low: 1, high: 2}}\npruner: {kind: median, max_resource: 5}",
     "pruner: the median pruner takes n_startup_trials, n_warmup_steps, interval_steps, n_min_trials, not max_resource"),
    ("- just a list", "expected a mapping with 'params'"),
    ("params: {x: [1, 2", "invalid YAML"),
])
def test_bad_space_file_is_one_line_naming_the_key(tmp_path, text, expected):
    path = write(tmp_path / "space.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_space(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)) and expected in message, message


@pytest.mark.parametrize(("params", "expected"), [
    ("trainer.train_stpes: {type: int, low: 10, high: 20}", "unknown field 'trainer.train_stpes' (did you mean"),
    ("trainer.steps_per_loop: {type: int, low: 0, high: 20}",
     "params.trainer.steps_per_loop: the value 0 makes the config invalid: trainer.steps_per_loop: expected"),
    ("model_dir: {type: categorical, choices: [a, b]}", "params.model_dir: model_dir is set by cadence sweep"),
])
def test_space_keys_are_checked_against_the_config(tmp_path, params, expected):
    space = load_space(write(tmp_path / "space.yaml", f"params:\n  {params}\n"))
    with pytest.raises(ConfigError) as info:
        check_against_config(space, load_config(DIGITS), "space.yaml")
    assert "\n" not in str(info.value) and str(info.value).startswith("space.yaml: ") and expected in str(info.value)


def test_cli_refuses_bad_input_in_one_line_before_anything_starts(tmp_path):
    bad = write(tmp_path / "bad.yaml", "params:\n  task.params.lr: {type: float, low: 0.1, high: 0.01}\n")
    unknown = write(tmp_path / "unknown.yaml", "params:\n  trainer.lr: {type: float, low: 0.001, high: 0.01}\n")
    sweep_dir = tmp_path / "sweep"
    for space, expected in ((bad, "bad.yaml: params.task.params.lr: low (0.1) is above high (0.01)"),
                            (unknown, "unknown.yaml: params.trainer.lr: unknown field 'trainer.lr'")):
        line = one_line_error(run_cadence("sweep", DIGITS, "--space", str(space), "--trials", "2",
                                          "--sweep-dir", str(sweep_dir)))
        assert expected in line, line
    assert not sweep_dir.exists()  # nothing was started


@pytest.mark.parametrize(("options", "expected"), [
    ({"space": "missing.yaml"}, "missing.yaml: space file not found"),
    ({"trials": 0}, "--trials: must be >= 1, got 0"),
    ({"parallel": 0}, "--parallel: must be >= 1, got 0"),
    ({"overrides": ["trainer.best_checkpoint=null", "export=null"]},
     "metric: not set, and the config has no trainer.best_checkpoint to take it from"),
    ({"overrides": ["trainer.best_checkpoint.metric=loss"], "metric": "accuracy"},
     "direction: not set for metric 'accuracy' (trainer.best_checkpoint watches another metric)"),
    ({"sweep_dir": "s3://bucket/sweep"}, "--sweep-dir: a sweep dir is local (its study is a sqlite file)"),
    ({"sweep_dir": "model"}, "is a model dir (it has checkpoints/); a sweep needs a directory of its own"),
])
def test_sweep_options_are_checked_before_anything_starts(tmp_path, options, expected):
    from cadence.sweep.runner import Sweep, SweepOptions

    metric = options.pop("metric", None)
    space = write(tmp_path / "space.yaml", "params:\n  task.params.lr: {type: float, low: 0.001, high: 0.01}\n"
                                           + (f"metric: {metric}\n" if metric else ""))
    given = {"config": DIGITS, "space": str(space), "trials": 2, "sweep_dir": str(tmp_path / "sweep"), **options}
    given["space"] = str(tmp_path / given["space"])
    if given["sweep_dir"] == "model":
        (tmp_path / "model" / "checkpoints").mkdir(parents=True)
        given["sweep_dir"] = str(tmp_path / "model")
    with pytest.raises(ConfigError) as info:
        Sweep(SweepOptions(**given))
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "sweep").exists()


def test_sweep_runs_trials_with_a_sidecar_when_asked_or_when_the_config_does_not_validate(tmp_path):
    from cadence.sweep.runner import Sweep, SweepOptions

    space = write(tmp_path / "space.yaml", "params:\n  task.params.lr: {type: float, low: 0.001, high: 0.01}\n")
    trial = tmp_path / "sweep" / "trial-3"
    for sidecar, sets in ((False, []), (True, []), (False, ["trainer.in_process_validation=false"])):
        sweep = Sweep(SweepOptions(config=DIGITS, space=str(space), trials=2, sweep_dir=str(tmp_path / "sweep"),
                                   overrides=sets, sidecar=sidecar))
        argv = sweep._command(trial / "config.yaml", trial)
        if sidecar or sets:
            assert argv[2:4] == ["cadence", "launch"] and "--sidecar" in argv and sweep.sidecar
        else:
            assert argv[2:4] == ["cadence", "train"] and not sweep.sidecar
        assert argv[argv.index("--model-dir") + 1] == str(trial)


def test_the_shipped_digits_space_runs_as_the_docs_write_it(tmp_path):
    """examples/digits/space.yaml, the file the README's and the guide's sweep command name: 2 short trials."""
    space = ROOT / "examples" / "digits" / "space.yaml"
    command = f"cadence sweep examples/digits/config.yaml --space {space.relative_to(ROOT)} "
    for page in (ROOT / "README.md", ROOT / "docs" / "guide" / "trackers-and-sweeps.md"):
        assert command in page.read_text(), page
    sweep_dir = tmp_path / "sweep"
    proc = run_cadence("sweep", "examples/digits/config.yaml", "--space", str(space.relative_to(ROOT)),
                       "--trials", "2", "--sweep-dir", str(sweep_dir), *FAST, "--set", "trainer.train_steps=50",
                       cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = study_of(sweep_dir).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in trials:
        assert 3.0e-4 <= t.params["task.params.lr"] <= 3.0e-2 and t.params["task.params.hidden"] in (32, 64, 128, 256)
        assert load_config(sweep_dir / f"trial-{t.number}" / "config.yaml").task.params["hidden"] == \
            t.params["task.params.hidden"]


# -- the pruning actions, with a real sqlite study and the real Controller ------------------------


class Evaluator:
    """``{"accuracy": values[step]}`` at the trainer's current step."""

    def __init__(self, trainer: FakeTrainer, values: dict[int, float]) -> None:
        self.trainer, self.values = trainer, values

    def evaluate(self, num_steps: int):
        return {"accuracy": self.values[self.trainer.step]}


def sqlite_study(tmp_path: Path, pruner: PrunerConfig) -> tuple[str, object]:
    from cadence.sweep._optuna import build_pruner

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s", direction="maximize", pruner=build_pruner(pruner))
    return url, study


def test_report_prunes_a_bad_trial_with_final_checkpoint_final_reason_and_decision(tmp_path):
    pruner = PrunerConfig(kind="median", n_startup_trials=1)
    url, study = sqlite_study(tmp_path, pruner)
    good = study.ask()  # a completed trial: the median to beat at each step
    for step, value in ((5, 0.5), (10, 0.9), (15, 0.9), (20, 0.9)):
        good.report(value, step)
    study.tell(good, 0.9)
    trial = study.ask()
    section = SweepTrialConfig(storage=url, study_name="s", trial_number=trial.number, metric="accuracy",
                               direction="maximize", pruner=pruner)
    model_dir = tmp_path / "trial"
    trainer = FakeTrainer()
    manager = CheckpointManager(str(model_dir / "checkpoints"))
    report = ReportToTrial.from_config(section, str(model_dir), stops=True)
    controller = Controller(trainer=trainer, evaluator=Evaluator(trainer, {5: 0.6, 10: 0.7, 15: 0.8, 20: 0.9}),
                            checkpoint_manager=manager, steps_per_loop=5, checkpoint_interval=20,
                            train_actions=[StopWhenPruned(str(model_dir))], eval_actions=[report], progress=False)
    with controller:
        controller.train_and_evaluate(train_steps=20, eval_interval=5)

    assert trainer.step == 10  # its best, 0.6 at 5, beats the median 0.5; 0.7 at 10 does not beat 0.9: stopped
    decision = read_decision(str(model_dir))
    assert decision is not None and (decision.step, decision.value, decision.by) == (10, 0.7, "in-process")
    assert decision.pruner == "MedianPruner" and decision.trial == trial.number
    final = json.loads((model_dir / "checkpoints" / "FINAL").read_text())
    assert final["step"] == 10 and final["reason"] == decision.reason
    assert "pruned by MedianPruner" in final["reason"] and "accuracy=0.7 at step 10" in final["reason"]
    assert manager.latest_step() == 10  # the final checkpoint, at the stop
    frozen = study.trials[trial.number]
    assert frozen.intermediate_values == {5: 0.6, 10: 0.7}
    assert frozen.state == optuna.trial.TrialState.RUNNING  # the sweep tells the study, not the trial


def test_a_step_reported_again_keeps_its_first_value(tmp_path, recwarn):
    pruner = PrunerConfig(kind="none")
    url, study = sqlite_study(tmp_path, pruner)
    trial = study.ask()
    section = SweepTrialConfig(storage=url, study_name="s", trial_number=trial.number, metric="accuracy",
                               direction="maximize", pruner=pruner)
    assert OptunaTrial(section).report(50, 0.5) is False
    resumed = OptunaTrial(section)  # a resumed run, in a new process: the same trial, the step evaluated again
    assert resumed.report(50, 0.7) is False and resumed.report(100, 0.8) is False
    assert study.trials[trial.number].intermediate_values == {50: 0.5, 100: 0.8}
    assert not [w for w in recwarn if "already reported" in str(w.message)]


def test_sidecar_report_writes_the_decision_and_the_trainer_stops_on_it(tmp_path):
    pruner = PrunerConfig(kind="median", n_startup_trials=0)
    url, study = sqlite_study(tmp_path, pruner)
    for value in (0.9, 0.8):  # two completed trials: median 0.85 at step 0 (where the sidecar evaluates)
        done = study.ask()
        done.report(value, 0)
        study.tell(done, value)
    trial = study.ask()
    section = SweepTrialConfig(storage=url, study_name="s", trial_number=trial.number, metric="accuracy",
                               direction="maximize", pruner=pruner)
    model_dir = str(tmp_path / "trial")
    os.makedirs(model_dir)
    sidecar_trainer = FakeTrainer()
    sidecar_trainer.step = 5
    sidecar = Controller(evaluator=Evaluator(sidecar_trainer, {5: 0.1}), restore=False, progress=False,
                         eval_actions=[ReportToTrial.from_config(section, model_dir, stops=False)])
    sidecar.evaluate()  # no StopTraining in a sidecar: it writes the decision
    assert sidecar.stop_reason is None
    decision = read_decision(model_dir)
    assert decision is not None and decision.by == "sidecar" and decision.step == 0
    with pytest.raises(StopTraining) as info:
        StopWhenPruned(model_dir)({"loss": 1.0})
    assert info.value.reason == decision.reason and "evaluated sidecar" in info.value.reason


def test_a_trial_whose_study_is_gone_fails_before_it_trains(tmp_path):
    url, study = sqlite_study(tmp_path, PrunerConfig())
    study.ask()
    for storage, trial, expected in ((f"sqlite:///{tmp_path / 'moved' / 'study.db'}", 0, "no such file (a moved sweep dir?"),
                                     (url, 5, "trial 5 of study 's'")):
        section = SweepTrialConfig(storage=storage, study_name="s", trial_number=trial, metric="accuracy",
                                   direction="maximize")
        with pytest.raises(CadenceError, match=re.escape(expected)):
            Controller(evaluator=Evaluator(FakeTrainer(), {0: 1.0}), restore=False, progress=False,
                       eval_actions=[ReportToTrial.from_config(section, str(tmp_path), stops=True)])
    assert not (tmp_path / "moved").exists()


def test_decision_file_round_trips_and_absent_means_not_pruned(tmp_path):
    assert read_decision(str(tmp_path)) is None
    StopWhenPruned(str(tmp_path))({})  # nothing to stop on
    decision = PruneDecision(trial=3, step=150, metric="loss", value=math.nan, pruner="HyperbandPruner", by="sidecar",
                             time=1.0)
    write_decision(str(tmp_path), decision)
    back = read_decision(str(tmp_path))
    assert back is not None and back.reason == decision.reason and math.isnan(back.value)


# -- the sweep dir --------------------------------------------------------------------------------


def test_best_link_is_relative_and_replaced_atomically(tmp_path):
    root = tmp_path / "sweep"
    for n in (0, 1):
        (root / f"trial-{n}" / "export" / "best" / "50").mkdir(parents=True)
        (root / f"trial-{n}" / "export" / "best" / "150").mkdir(parents=True)
    link = root / "best"
    assert point_best(link, root / "trial-0") == Path("trial-0/export/best/150")
    assert os.readlink(link) == "trial-0/export/best/150" and link.resolve() == (root / "trial-0/export/best/150")
    assert point_best(link, root / "trial-1") == Path("trial-1/export/best/150")
    assert link.resolve() == (root / "trial-1/export/best/150").resolve()
    assert sorted(p.name for p in root.iterdir()) == ["best", "trial-0", "trial-1"]  # no temp link left
    bare = root / "trial-2"
    (bare / "best" / "ckpt-40").mkdir(parents=True)  # no export: the best checkpoint
    assert point_best(link, bare) == Path("trial-2/best/ckpt-40")


def test_best_link_replaces_only_a_link_cadence_made(tmp_path, caplog):
    """Issue 39: a real file or directory at SWEEP_DIR/best, or a link pointing anywhere but into a trial,
    is the user's: left as it is (a warning), never replaced."""
    root = tmp_path / "sweep"
    (root / "trial-0" / "export" / "best" / "50").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    link = root / "best"
    for target in (str(tmp_path / "mine"), "../mine", "trial-x/export", "trial-0/../../mine"):
        os.symlink(target, link)
        with caplog.at_level(logging.WARNING, logger="cadence.sweep"):
            assert point_best(link, root / "trial-0") is None
        assert os.readlink(link) == target and f"points at {target}, not into a trial" in caplog.text
        link.unlink()
    link.write_text("mine")
    assert point_best(link, root / "trial-0") is None and link.read_text() == "mine"
    link.unlink()
    (link / "sub").mkdir(parents=True)
    assert point_best(link, root / "trial-0") is None and (link / "sub").is_dir() and not link.is_symlink()
    (link / "sub").rmdir()
    link.rmdir()
    os.symlink("trial-7/best/ckpt-10", link)  # cadence's own, even when the trial is gone
    assert point_best(link, root / "trial-0") == Path("trial-0/export/best/50")
    assert sorted(p.name for p in root.iterdir()) == ["best", "trial-0"]


def test_one_sweep_at_a_time_on_a_sweep_dir(tmp_path):
    sweep_dir = SweepDir.at(str(tmp_path / "sweep"))
    with SweepLock(sweep_dir):
        with pytest.raises(ConfigError, match=rf"another cadence sweep \(pid {os.getpid()}\) is running"):
            with SweepLock(sweep_dir):
                pass
    with SweepLock(sweep_dir):  # released
        pass
    with pytest.raises(ConfigError, match="a sweep dir is local"):
        SweepDir.at("s3://bucket/sweep")


# -- end to end: the digits example ---------------------------------------------------------------

# With this seed the random sampler gives, in order: lr=0.01 dropout=0.1 (good) twice, then a bad lr, a good
# one, a dropout of 1.5 (nn.Dropout refuses it: the trial crashes), a bad lr. The first two trials complete
# (the pruner waits for one complete trial), so a bad lr is always below the median of the complete ones.
PRUNE_SPACE = """
params:
  task.params.lr: {type: categorical, choices: [1.0e-5, 0.01]}
  task.params.dropout: {type: categorical, choices: [0.1, 1.5]}
sampler: random
seed: 47
pruner: {kind: median, n_startup_trials: 1}
"""
BAD_LR, CRASH_DROPOUT = 1.0e-5, 1.5


@pytest.fixture(scope="module")
def pruned_sweep(tmp_path_factory):
    """A 6-trial sweep of digits (200 steps), 2 trials at a time: ``(sweep_dir, process)``."""
    tmp = tmp_path_factory.mktemp("sweep")
    space = write(tmp / "space.yaml", PRUNE_SPACE)
    sweep_dir = tmp / "sweep"
    started = time.monotonic()
    proc = run_cadence("sweep", DIGITS, "--space", str(space), "--trials", "6", "--parallel", "2",
                       "--sweep-dir", str(sweep_dir), *FAST, "--set", "trainer.train_steps=200", timeout=300)
    print(f"6-trial sweep: {time.monotonic() - started:.1f} s")
    return sweep_dir, space, proc


def study_of(sweep_dir: Path):
    record = json.loads((sweep_dir / "sweep.json").read_text())
    return optuna.load_study(study_name=record["study_name"], storage=f"sqlite:///{sweep_dir / 'study.db'}")


def test_sweep_prunes_bad_trials_records_a_crash_and_links_the_best(pruned_sweep):
    sweep_dir, _, proc = pruned_sweep
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = study_of(sweep_dir)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(6))
    assert sorted(p.name for p in sweep_dir.glob("trial-*")) == [f"trial-{n}" for n in range(6)]
    states = optuna.trial.TrialState
    by_kind = {"pruned": [], "failed": [], "complete": []}
    for t in trials:
        trial_dir = sweep_dir / f"trial-{t.number}"
        config = load_config(trial_dir / "config.yaml")
        assert config.task.params["lr"] == t.params["task.params.lr"]  # the sampled values, in its config.yaml
        assert config.task.params["dropout"] == t.params["task.params.dropout"]
        assert config.sweep_trial is not None and config.sweep_trial.trial_number == t.number
        if t.params["task.params.dropout"] == CRASH_DROPOUT:
            assert t.state == states.FAIL and "dropout probability" in t.user_attrs["error"], t.user_attrs
            by_kind["failed"].append(t.number)
            continue
        final = json.loads((trial_dir / "checkpoints" / "FINAL").read_text())
        if t.params["task.params.lr"] == BAD_LR:
            assert t.state == states.PRUNED
            decision = json.loads((trial_dir / "pruned.json").read_text())
            assert final["step"] == decision["step"] == 50  # stopped at its first evaluation
            assert final["reason"].startswith("pruned by MedianPruner") and "accuracy=" in final["reason"]
            assert t.user_attrs["pruned"] == final["reason"]
            assert (trial_dir / "checkpoints" / "ckpt-50").is_dir()  # the final checkpoint, at the stop
            by_kind["pruned"].append(t.number)
        elif t.state == states.COMPLETE:
            assert final["step"] == 200 and "reason" not in final
            values = [r["accuracy"] for r in map(json.loads, (trial_dir / "eval" / "metrics.jsonl").open())]
            assert t.value == max(values)  # the trial's value: its best evaluation
            by_kind["complete"].append(t.number)
        else:  # a good trial below the median of the complete ones may be pruned too
            assert t.state == states.PRUNED, t.state
    assert by_kind["pruned"] and by_kind["failed"] and len(by_kind["complete"]) >= 2, by_kind
    assert f"trial {by_kind['failed'][0]}: FAILED" in proc.stdout
    assert "sweep done:" in proc.stdout and f"best: trial {study.best_trial.number}:" in proc.stdout

    best = study.best_trial
    assert best.value == max(t.value for t in trials if t.state == states.COMPLETE)
    link = sweep_dir / "best"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    exported = sweep_dir / f"trial-{best.number}" / "export" / "best"
    best_step = json.loads((sweep_dir / f"trial-{best.number}" / "best" / "best.json").read_text())["step"]
    assert link.resolve() == (exported / str(best_step)).resolve()
    assert (link / "model.safetensors").is_file()


def test_ls_and_report_of_the_sweep(pruned_sweep):
    sweep_dir, _, _ = pruned_sweep
    study = study_of(sweep_dir)
    proc = run_cadence("ls", str(sweep_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert listing["metric"] == "accuracy" and listing["best"]["number"] == study.best_trial.number
    rows = {r["number"]: r for r in listing["trials"]}
    for t in study.get_trials():
        row = rows[t.number]
        assert row["state"] == t.state.name.lower() and row["params"] == t.params and row["starts"] == 1
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert row["best_value"] == t.value and row["steps"] == 200
        if t.state == optuna.trial.TrialState.PRUNED:
            assert row["steps"] < 200 and row["pruned"].startswith("pruned by MedianPruner")
    lines = format_sweep_table(listing, width=120).splitlines()  # what cadence ls prints without --json
    header = next(line for line in lines if line.startswith("trial"))
    assert "best accuracy" in header and "lr" in header and "dropout" in header
    best_row = next(line for line in lines if line.lstrip().startswith(f"{study.best_trial.number} ") and "BEST" in line)
    assert "complete" in best_row
    assert any(line.startswith("trial ") and ": failed: " in line and "dropout probability" in line for line in lines)
    assert lines[-1].startswith(f"best: trial {study.best_trial.number}: accuracy=")

    proc = run_cadence("report", str(sweep_dir))
    assert proc.returncode == 0, proc.stderr
    html_path, png_path = (Path(p) for p in proc.stdout.split())
    assert html_path == sweep_dir / "report.html" and png_path.read_bytes().startswith(b"\x89PNG")
    page = html_path.read_text()
    assert "cadence sweep report" in page and "Parameter importance" in page
    assert "task.params.lr" in page and 'src="http' not in page
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials())
    importances = optuna.importance.get_param_importances(study)
    for key in importances:  # Optuna's importances, as computed from the study
        assert f"<td>{key}</td>" in page
    assert complete >= 2


def test_a_second_run_with_another_config_or_space_is_refused(pruned_sweep):
    sweep_dir, space, _ = pruned_sweep
    other = write(space.with_name("other.yaml"), PRUNE_SPACE.replace("seed: 47", "seed: 48"))
    line = one_line_error(run_cadence("sweep", DIGITS, "--space", str(other), "--trials", "6", "--sweep-dir",
                                      str(sweep_dir), *FAST, "--set", "trainer.train_steps=200"))
    assert "holds a sweep of another space (it differs at seed)" in line
    line = one_line_error(run_cadence("sweep", DIGITS, "--space", str(space), "--trials", "6", "--sweep-dir",
                                      str(sweep_dir), *FAST, "--set", "trainer.train_steps=300"))
    assert "holds a sweep of another config (it differs at trainer.train_steps)" in line
    # the same command again: every trial is finished, nothing runs
    proc = run_cadence("sweep", DIGITS, "--space", str(space), "--trials", "6", "--parallel", "2", "--sweep-dir",
                       str(sweep_dir), *FAST, "--set", "trainer.train_steps=200")
    assert proc.returncode == 0, proc.stderr
    assert "started" not in proc.stdout and "resumed" not in proc.stdout and "sweep done:" in proc.stdout
    assert all(len(json.loads(p.read_text())["starts"]) == 1 for p in sweep_dir.glob("trial-*/trial.json"))


RESUME_SPACE = """
params:
  task.params.lr: {type: categorical, choices: [0.01]}
pruner: {kind: none}
"""
"""Every trial alike: a resumed trial must end with the weights of one that ran without a stop."""


def test_kill_9_of_the_sweep_then_the_same_command_resumes(tmp_path):
    space = write(tmp_path / "space.yaml", RESUME_SPACE)
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "cadence", "sweep", DIGITS, "--space", str(space), "--trials", "3", "--parallel", "2",
            "--sweep-dir", str(sweep_dir), *FAST, "--set", "trainer.train_steps=300"]
    sweep = popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    interrupted = None
    while interrupted is None and time.monotonic() < deadline and sweep.poll() is None:
        for trial_dir in sweep_dir.glob("trial-*"):  # a trial past its first checkpoint, not finished
            if (trial_dir / "checkpoints" / "ckpt-50" / "MANIFEST.json").exists() and \
                    not (trial_dir / "checkpoints" / "FINAL").exists():
                interrupted = trial_dir
                break
        time.sleep(0.01)
    assert interrupted is not None, "no trial reached its first checkpoint"
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.communicate(timeout=30)
    finished_before = {p.parent.parent.name: p.stat().st_mtime_ns for p in sweep_dir.glob("trial-*/checkpoints/FINAL")}

    proc = run_python(args, timeout=240)  # the same command
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trial {interrupted.name.split('-')[1]}: resumed from its checkpoints" in proc.stdout
    study = study_of(sweep_dir)
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2]  # none lost, none added twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert sorted(p.name for p in sweep_dir.glob("trial-*")) == ["trial-0", "trial-1", "trial-2"]
    runs = {}
    for t in trials:
        trial_dir = sweep_dir / f"trial-{t.number}"
        runs[trial_dir] = len(json.loads((trial_dir / "trial.json").read_text())["starts"])
        if trial_dir.name in finished_before:  # finished before the kill: never run again
            assert runs[trial_dir] == 1
            assert (trial_dir / "checkpoints" / "FINAL").stat().st_mtime_ns == finished_before[trial_dir.name]
        steps = [json.loads(line)["step"] for line in (trial_dir / "train" / "metrics.jsonl").open()]
        assert steps == sorted(set(steps)) and steps[-1] == 300  # each step trained once, to the end
    assert runs[interrupted] == 2
    # Some trial ran without a stop (one finished before the kill, or trial 2 started after it): the same
    # weights as the resumed one's.
    whole = next(d for d, n in runs.items() if n == 1)
    assert same_weights(checkpoint_weights(interrupted / "checkpoints" / "ckpt-300"),
                        checkpoint_weights(whole / "checkpoints" / "ckpt-300"))


SIDECAR_SPACE = """
params:
  task.params.lr: {type: categorical, choices: [1.0e-5]}
pruner: {kind: successive_halving, min_resource: 50, bootstrap_count: 1}
"""
"""Successive halving with bootstrap_count 1 prunes a trial alone at its first rung (step 50): the sidecar's
first evaluation decides, whatever the other trials do."""


def test_a_sidecar_evaluator_prunes_the_trial(tmp_path):
    space = write(tmp_path / "space.yaml", SIDECAR_SPACE)
    sweep_dir = tmp_path / "sweep"
    proc = run_cadence("sweep", DIGITS, "--space", str(space), "--trials", "1", "--sweep-dir", str(sweep_dir),
                       "--sidecar", *FAST, "--set", "trainer.train_steps=1000", "--set", "sidecar.poll_interval=0.05",
                       "--set", "trainer.max_to_keep=null", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # its one trial pruned: nothing complete, nothing best
    assert "no trial completed" in proc.stdout
    (trial,) = study_of(sweep_dir).get_trials()
    assert trial.state == optuna.trial.TrialState.PRUNED
    trial_dir = sweep_dir / "trial-0"
    decision = json.loads((trial_dir / "pruned.json").read_text())
    final = json.loads((trial_dir / "checkpoints" / "FINAL").read_text())
    assert decision["by"] == "sidecar" and decision["step"] == 50 and decision["pruner"] == "SuccessiveHalvingPruner"
    assert final["reason"] == trial.user_attrs["pruned"] and final["reason"].endswith("evaluated sidecar")
    assert 50 <= final["step"] < 1000  # the trainer stopped early, on the sidecar's decision
    evaluated = [json.loads(line) for line in (trial_dir / "eval" / "evaluations.jsonl").open()]
    assert evaluated[-1]["step"] == final["step"]  # the sidecar went on to the final checkpoint, then ended
    log = (trial_dir / "trial.log").read_text()
    assert "[trainer]" in log and "[sidecar]" in log  # cadence launch --sidecar: both processes
