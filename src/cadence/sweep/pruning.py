"""Pruning inside a sweep trial's run (the config's ``sweep_trial:`` section).

* :class:`ReportToTrial` -- an eval action: reports the metric of each evaluation, at its global
  step, to the trial's Optuna trial and asks the study's pruner. When the pruner says prune it
  writes the decision, ``MODEL_DIR/pruned.json`` (atomically), and, in the trainer's own
  evaluations, raises :class:`~cadence.errors.StopTraining`: the controller saves the final
  checkpoint and writes ``FINAL`` with the reason. In a sidecar evaluator it only writes the
  decision (a sidecar cannot stop the trainer's loop).
* :class:`StopWhenPruned` -- a train action of the trainer: at each loop boundary it looks for
  ``pruned.json`` (one stat) and raises ``StopTraining`` with its reason. This is how a sidecar's
  decision stops the trainer, and how a trial resumed after its decision stops again.

Only the chief reports; a stop on any rank stops them all (the controller agrees on it).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from cadence.actions.metric_path import check_metric, get_metric
from cadence.config.schema import SweepTrialConfig
from cadence.errors import CadenceError, StopTraining
from cadence.extensions import RunContext
from cadence.storage import Storage

logger = logging.getLogger("cadence.sweep")

__all__ = ["PRUNED_FILE", "OptunaTrial", "PruneDecision", "ReportToTrial", "StopWhenPruned", "read_decision",
           "write_decision"]

PRUNED_FILE = "pruned.json"
"""``MODEL_DIR/pruned.json``: the pruner's decision that stopped a sweep trial."""


@dataclass(frozen=True)
class PruneDecision:
    """Why and where a trial was pruned."""

    trial: int
    step: int
    metric: str
    value: float
    pruner: str  # Optuna's class name, MedianPruner
    by: str  # "in-process" or "sidecar": who evaluated and decided
    time: float

    @property
    def reason(self) -> str:
        return (f"pruned by {self.pruner} (sweep trial {self.trial}): {self.metric}={self.value:.6g} at step "
                f"{self.step}, evaluated {self.by}")


def _path(model_dir: str) -> tuple[Storage, str]:
    storage = Storage(model_dir)
    return storage, storage.join(PRUNED_FILE)


def write_decision(model_dir: str, decision: PruneDecision) -> None:
    """Write ``MODEL_DIR/pruned.json`` atomically (a reader sees the whole decision or none)."""
    storage, path = _path(model_dir)
    storage.write_atomic(path, (json.dumps(asdict(decision)) + "\n").encode())


def read_decision(model_dir: str) -> PruneDecision | None:
    """The trial's prune decision; None when it was not pruned (or the file is unreadable: warned)."""
    storage, path = _path(model_dir)
    try:
        doc = json.loads(storage.read_bytes(path))
        return PruneDecision(**{k: doc[k] for k in PruneDecision.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable %s: %s", storage.url(path), e)
        return None


class OptunaTrial:
    """The Optuna trial a sweep trial's run reports to, in the study of ``section``: connected (and
    Optuna imported) by :meth:`connect` or the first :meth:`report`, which raise
    :class:`~cadence.errors.CadenceError` when the study or the trial is not in the storage."""

    def __init__(self, section: SweepTrialConfig) -> None:
        self.section = section
        self._trial: Any = None
        self._reported: set[int] = set()
        self._finished: str | None = None  # the trial's state when the study had finished it already
        self.pruner_name = ""

    def connect(self) -> Any:
        """The Optuna trial (connected once). CadenceError: no such study file, study or trial."""
        if self._trial is not None:
            return self._trial
        from cadence.sweep._optuna import build_pruner, open_storage, pruner_name, require_optuna

        optuna = require_optuna("sweep_trial")
        import sqlalchemy.exc  # optuna's own dependency: there once optuna is

        s = self.section
        where = f"sweep_trial: trial {s.trial_number} of study {s.study_name!r} in {s.storage}"
        if s.storage.startswith("sqlite:///") and not Path(s.storage.removeprefix("sqlite:///")).is_file():
            raise CadenceError(f"{where}: no such file (a moved sweep dir? cadence sweep rewrites its trials' "
                               "config.yaml when it runs them)")
        pruner = build_pruner(s.pruner)
        try:
            storage = open_storage(s.storage, create=False)
            study_id = storage.get_study_id_from_name(s.study_name)
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, s.trial_number)
        except (KeyError, sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.OptunaError) as e:
            raise CadenceError(f"{where}: not found ({e})") from None
        # The sampler is never used here (the sweep sampled the parameters); a random one costs nothing.
        study = optuna.load_study(study_name=s.study_name, storage=storage, pruner=pruner,
                                  sampler=optuna.samplers.RandomSampler())
        frozen = storage.get_trial(trial_id)
        self._reported = set(frozen.intermediate_values)
        self._finished = frozen.state.name if frozen.state.is_finished() else None
        self._trial = optuna.trial.Trial(study, trial_id)
        self.pruner_name = pruner_name(pruner)
        return self._trial

    def report(self, step: int, value: float) -> bool:
        """Report ``value`` at ``step``; whether the pruner says to prune now. A step reported before
        (a resumed run evaluating it again) keeps its first value; a trial the study has finished
        already takes no report and is not pruned."""
        trial = self.connect()
        if self._finished is not None:
            logger.warning("sweep trial %d is %s in the study already: not reported", self.section.trial_number,
                           self._finished)
            return False
        if step not in self._reported:
            trial.report(float(value), step)
            self._reported.add(step)
        return bool(trial.should_prune())


class ReportToTrial:
    """An eval action: report each evaluation's ``metric`` to the sweep trial; on the pruner's word
    write ``pruned.json`` and, with ``stops`` (the trainer's evaluations), raise ``StopTraining``.

    After a decision it reports nothing more. Only the chief reports (others do nothing)."""

    def __init__(self, trial: OptunaTrial, metric: str, model_dir: str, *, stops: bool) -> None:
        self.trial = trial
        self.metric = metric
        self.model_dir = model_dir
        self.stops = stops
        self._run: RunContext | None = None

    @classmethod
    def from_config(cls, section: SweepTrialConfig, model_dir: str, *, stops: bool) -> ReportToTrial:
        return cls(OptunaTrial(section), section.metric, model_dir, stops=stops)

    def attach(self, run: RunContext) -> None:
        """Connect the chief to the study now: a sidecar is ready before its trainer starts, and a
        missing study fails the run before it trains."""
        self._run = run
        if run.coordinator.is_chief:
            self.trial.connect()

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """ConfigError when the evaluation holds no number under ``sweep_trial.metric``."""
        check_metric(metrics, self.metric, "sweep_trial")

    def __call__(self, metrics: Mapping[str, Any]) -> None:
        run = self._run
        if run is None:
            raise RuntimeError("ReportToTrial must be attached to a Controller (pass it in eval_actions)")
        if not run.coordinator.is_chief or read_decision(self.model_dir) is not None:
            return
        value, step = get_metric(metrics, self.metric), int(run.global_step)
        if not self.trial.report(step, value):
            return
        decision = PruneDecision(trial=self.trial.section.trial_number, step=step, metric=self.metric,
                                 value=value if math.isfinite(value) else float("nan"),
                                 pruner=self.trial.pruner_name, by="in-process" if self.stops else "sidecar",
                                 time=time.time())
        write_decision(self.model_dir, decision)
        logger.warning("%s", decision.reason)
        if self.stops:
            raise StopTraining(decision.reason)


class StopWhenPruned:
    """A train action: raise ``StopTraining`` (with the decision's reason) once ``pruned.json``
    exists in ``model_dir``."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._storage, self._path = _path(model_dir)

    def __call__(self, logs: Mapping[str, Any]) -> None:
        if not self._storage.exists(self._path):
            return
        decision = read_decision(self.model_dir)
        if decision is not None:
            raise StopTraining(decision.reason)
