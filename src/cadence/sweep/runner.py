"""``cadence sweep``: run the trials of a study, at most ``parallel`` at a time, each a normal cadence
run (``cadence train``, or ``cadence launch --sidecar``) in ``SWEEP_DIR/trial-<n>/`` whose
``config.yaml`` holds the sampled parameters and the ``sweep_trial:`` section.

The study (sqlite, ``SWEEP_DIR/study.db``) is the truth about every trial: one it has finished
(complete, pruned, failed) is never run again; one it holds as running (the sweep was killed or
stopped) is run again in its trial dir, which resumes it exactly from its checkpoints -- or, when
its ``FINAL`` exists already, only told to the study. New trials are asked for until the study
holds ``trials`` of them. A trial process gets SIGTERM when the sweep dies (``PR_SET_PDEATHSIG``
on Linux): it commits a checkpoint at the end of its loop and exits; the next run waits for it to
be gone (its writer lease) before resuming it.

A trial's outcome: ``FINAL`` and ``pruned.json`` -> pruned; ``FINAL`` alone -> complete, its value
the best value of the metric over its evaluations; a process that exits otherwise -> failed, with
the error line of its log (``trial-<n>/trial.log``) as the trial's ``error`` user attribute.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence import layout
from cadence.config.schema import ExperimentConfig
from cadence.errors import ConfigError
from cadence.summaries.progress import format_value
from cadence.cluster.launch import die_with_parent
from cadence.runtime.signals import install_handlers, signal_name
from cadence.sweep.best_link import point_best
from cadence.sweep.pruning import read_decision
from cadence.sweep.space import SweepSpace, check_against_config, distributions, load_space, set_params
from cadence.sweep.study import SweepDir, SweepLock, new_record, open_study
from cadence.sweep.trials import TRIAL_LOG, TrialRecord, best_value, failure_line, read_final, trial_steps

logger = logging.getLogger("cadence.sweep")

__all__ = ["Sweep", "SweepOptions", "SweepResult"]

_POLL_S = 0.1
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@dataclass
class SweepOptions:
    """What ``cadence sweep`` was given."""

    config: str
    space: str
    trials: int
    parallel: int = 1
    sweep_dir: str | None = None
    overrides: Sequence[str] = ()
    sidecar: bool = False
    grace_s: float = 30.0
    python: str = sys.executable


@dataclass
class SweepResult:
    """How a run of the sweep ended: the study's trials by state, the best trial, and the signal
    that stopped the sweep before it was done (None: it ran every trial)."""

    counts: dict[str, int]
    best: dict[str, Any] | None
    stopped_by: int | None = None


@dataclass
class _Process:
    number: int
    proc: subprocess.Popen[bytes]
    log_offset: int
    kill_at: float | None = None


@dataclass
class _Queue:
    resume: list[int] = field(default_factory=list)  # trials the study holds as running, to run again
    waiting_note: set[int] = field(default_factory=set)  # resumed trials whose previous process is alive


class Sweep:
    """One run of ``cadence sweep``. Built from :class:`SweepOptions`, it checks everything that can
    be checked before a process starts (ConfigError, exit 2: the config, the space and its keys,
    the sweep dir, a sweep dir holding another sweep, optuna missing); :meth:`run` runs the trials.

    ``out`` receives one line per event (trial started, resumed, finished, the summary)."""

    def __init__(self, options: SweepOptions, out: Callable[[str], None] | None = None) -> None:
        from cadence.config import load_config
        from cadence.sweep._optuna import require_optuna

        if options.trials < 1:
            raise ConfigError(f"--trials: must be >= 1, got {options.trials}")
        if options.parallel < 1:
            raise ConfigError(f"--parallel: must be >= 1, got {options.parallel}")
        self.options = options
        self.out = out or (lambda line: print(line, flush=True))
        require_optuna()
        self.space: SweepSpace = load_space(options.space)
        self.base: ExperimentConfig = load_config(options.config, overrides=options.overrides)
        where = options.sweep_dir or self.base.model_dir
        if not where:
            raise ConfigError("--sweep-dir: not given, and the config has no model_dir to use instead")
        self.dir = SweepDir.at(where)
        check_against_config(self.space, self.base, options.space)
        self.metric, self.direction = self._objective()
        self.sidecar = options.sidecar or not self.base.trainer.in_process_validation
        self.eval_name = self.base.sidecar.name if self.sidecar else None
        self.base_data = self.base.to_dict()
        self._warn_about_pruning()
        self.study: Any = None
        self.storage: Any = None
        self.record: Any = None
        self._study_id = -1
        self._running: dict[int, _Process] = {}
        self._signals: list[int] = []
        self._best_number: int | None = None

    # -- checks ---------------------------------------------------------------------------------

    def _objective(self) -> tuple[str, str]:
        best = self.base.trainer.best_checkpoint
        metric = self.space.metric or (best.metric if best is not None else None)
        assert metric is not None, "checked by check_against_config"
        if self.space.direction is not None:
            return metric, self.space.direction
        if best is not None and best.metric == metric:
            return metric, "maximize" if best.higher_is_better else "minimize"
        raise ConfigError(f"{self.options.space}: direction: not set for metric {metric!r} (trainer.best_checkpoint "
                          "watches another metric): give direction: maximize or minimize")

    def _warn_about_pruning(self) -> None:
        if self.space.pruner.kind == "none":
            return
        t = self.base.trainer
        if not self.sidecar and t.validation_interval is None:
            logger.warning("trainer.validation_interval is null: each trial evaluates once, at its end, so the "
                           "pruner cannot stop a trial early (set trainer.validation_interval)")
        if self.sidecar and t.checkpoint_interval is None:
            logger.warning("trainer.checkpoint_interval is null: the sidecar evaluates the final checkpoint only, "
                           "so the pruner cannot stop a trial early")

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> SweepResult:
        """Run (or resume) the sweep until the study holds ``trials`` finished trials, or a signal
        (SIGINT, SIGTERM, SIGHUP) stops it: then every trial process gets SIGTERM (SIGKILL after
        ``grace_s``, or at a second signal), and those unfinished stay running in the study for the
        next run to resume."""
        optuna = self._optuna()
        with SweepLock(self.dir):
            wanted = new_record(metric=self.metric, direction=self.direction,
                                evaluation="sidecar" if self.sidecar else "in-process",
                                config={k: v for k, v in self.base_data.items() if k != "model_dir"}, space=self.space)
            self.record, self.study, self.storage = open_study(self.dir, wanted, self.space)
            record = self.record
            self._study_id = self.storage.get_study_id_from_name(record.study_name)
            self.out(f"sweep {self.dir.root}: study {record.study_name} ({self.dir.study_file.name}), "
                     f"{self.direction} {self.metric}, {self.options.trials} trials, {self.options.parallel} at a time"
                     + (", evaluated by a sidecar" if self.sidecar else ""))
            queue = _Queue(resume=[t.number for t in self.study.get_trials(deepcopy=False)
                                   if t.state == optuna.trial.TrialState.RUNNING])
            for number in list(queue.resume):  # finished before the last run could tell the study
                if read_final(self.dir.trial_dir(number)) is not None:
                    queue.resume.remove(number)
                    self._finish(number, 0, offset=None)
            self._update_best()
            handlers = install_handlers(_STOP_SIGNALS, lambda signum, _frame: self._signals.append(signum),
                                        owner="cadence sweep")
            try:
                self._loop(queue)
            finally:
                try:
                    self._stop_all(kill=False)
                    self._wait_all()
                finally:
                    handlers.restore()
            return self._result()

    def _optuna(self) -> Any:
        from cadence.sweep._optuna import require_optuna

        return require_optuna()

    def _loop(self, queue: _Queue) -> None:
        handled = 0
        while True:
            for number, process in list(self._running.items()):
                code = process.proc.poll()
                if code is not None:
                    del self._running[number]
                    self._finish(number, code, offset=process.log_offset)
            if len(self._signals) > handled:
                if handled == 0:
                    self.out(f"sweep: received {signal_name(self._signals[0])}: stopping "
                             f"{len(self._running)} running trial(s); run the same command to resume")
                self._stop_all(kill=handled > 0)
                handled = len(self._signals)
            if self._signals:
                if not self._running:
                    return
                self._kill_overdue()
                time.sleep(_POLL_S)
                continue
            while len(self._running) < self.options.parallel and self._start_next(queue):
                pass
            if not self._running and not queue.resume and self._total() >= self.options.trials:
                return
            time.sleep(_POLL_S)

    def _total(self) -> int:
        return len(self.study.get_trials(deepcopy=False))

    def _start_next(self, queue: _Queue) -> bool:
        """Start one trial (a resumed one first, whose previous process is gone); False if none."""
        for number in list(queue.resume):
            holder = self._previous_process(number)
            if holder is not None:
                if number not in queue.waiting_note:
                    queue.waiting_note.add(number)
                    self.out(f"trial {number}: waiting for {holder} (of the sweep's last run) to stop")
                continue
            queue.resume.remove(number)
            trial = next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)
            self._start(number, dict(trial.params), resumed=True)
            return True
        if self._total() >= self.options.trials:
            return False
        trial = self.study.ask(distributions(self.space))
        self._start(trial.number, dict(trial.params), resumed=False)
        return True

    def _previous_process(self, number: int) -> str | None:
        """What still works in the trial dir from a killed sweep's run, or None when the dir is free:
        the holder of its writer lease when that is a live process (a trainer saving its checkpoint
        after SIGTERM), or, with a sidecar, the sidecar's lease (it ends when the sidecar stops, or
        expires ``sidecar.lease_ttl`` after a kill)."""
        from cadence.checkpoint import writer_lease
        from cadence.checkpoint.leases import Leases
        from cadence.sidecar.evaluator import lease_holder

        trial_dir = self.dir.trial_dir(number)
        if (trial_dir / layout.WRITER).is_dir():
            holder = writer_lease.current_lease(str(trial_dir))
            if holder is not None and holder.held(time.time()) and not holder.replaceable():
                return f"the trainer, pid {holder.pid}"
        if self.sidecar and (trial_dir / layout.CHECKPOINTS).is_dir():
            name = lease_holder(self.base.sidecar.name)
            if any(lease.holder == name for lease in Leases(layout.checkpoints_dir(str(trial_dir))).active()):
                return f"its sidecar, lease {name}"
        return None

    def _start(self, number: int, params: dict[str, Any], *, resumed: bool) -> None:
        trial_dir = self.dir.trial_dir(number)
        record = TrialRecord.read(trial_dir) or TrialRecord(number=number, params=params)
        try:
            config_path = self._write_trial_config(number, params)
        except ConfigError as e:  # sampled values the config refuses (the ends of each range were checked)
            self._tell_failed(number, record, f"its config is invalid: {e}")
            return
        argv = self._command(config_path, trial_dir)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(trial_dir / TRIAL_LOG, "ab") as log:  # the child keeps its own descriptor
            offset = log.tell()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, close_fds=True, preexec_fn=die_with_parent())
            except OSError as e:
                self._tell_failed(number, record, f"cannot start {argv[0]!r}: {e}")
                return
        record.started(proc.pid)
        record.write(trial_dir)
        self._set_attr(number, "trial_dir", trial_dir.name)
        self._running[number] = _Process(number, proc, offset)
        shown = "  ".join(f"{k}={format_value(v)}" for k, v in params.items())
        verb = "resumed from its checkpoints" if resumed and (trial_dir / layout.CHECKPOINTS).is_dir() else "started"
        self.out(f"trial {number}: {verb}: {shown}  ({trial_dir.name}/)")

    def _write_trial_config(self, number: int, params: dict[str, Any]) -> Path:
        from cadence.config.loading import config_from_dict, save_config

        trial_dir = self.dir.trial_dir(number)
        data = set_params(self.base_data, params)
        data["model_dir"] = str(trial_dir)
        data["sweep_trial"] = {
            "storage": self.dir.storage_url, "study_name": self.record.study_name, "trial_number": number,
            "metric": self.metric, "direction": self.direction, "pruner": self.space.pruner.model_dump(),
        }
        cfg = config_from_dict(data, source=f"trial {number}'s config", config_dir=self.base.config_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        path = Path(layout.config_path(str(trial_dir)))
        save_config(cfg, path)
        return path

    def _command(self, config_path: Path, trial_dir: Path) -> list[str]:
        python, config, model_dir = self.options.python, str(config_path), str(trial_dir)
        if self.sidecar:
            return [python, "-m", "cadence", "launch", config, "--model-dir", model_dir, "--sidecar",
                    "--grace", f"{self.options.grace_s:g}"]
        return [python, "-m", "cadence", "train", config, "--model-dir", model_dir, "--no-progress"]

    # -- outcomes --------------------------------------------------------------------------------

    def _finish(self, number: int, code: int, *, offset: int | None) -> None:
        """Tell the study how trial ``number`` ended (its process exited with ``code``; ``offset``:
        where its output starts in the log, None when no process ran now)."""
        optuna = self._optuna()
        trial_dir = self.dir.trial_dir(number)
        record = TrialRecord.read(trial_dir) or TrialRecord(number=number, params={})
        final = read_final(trial_dir)
        if self._signals and (code != 0 or final is None):  # stopped by this sweep: its next run resumes it
            self.out(f"trial {number}: stopped at step {trial_steps(trial_dir) or 0}; the next run resumes it")
            return
        if code != 0:
            how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
            self._tell_failed(number, record, f"{how}: {failure_line(trial_dir / TRIAL_LOG, offset or 0)}")
            return
        if final is None:
            self._tell_failed(number, record, "exited without finishing (no FINAL: stopped by a signal?)")
            return
        record.final_step = int(final["step"])
        record.reason = final.get("reason")
        decision = read_decision(str(trial_dir))
        self._set_attr(number, "final_step", record.final_step)
        if decision is not None:
            record.state, record.reason, record.ended = "pruned", decision.reason, time.time()
            self._set_attr(number, "pruned", decision.reason)
            record.write(trial_dir)
            self.study.tell(number, state=optuna.trial.TrialState.PRUNED)
            self.out(f"trial {number}: pruned at step {decision.step}: {decision.metric}={decision.value:.6g} "
                     f"({decision.pruner}, evaluated {decision.by})")
            return
        best = best_value(trial_dir, self.metric, self.direction, self.eval_name)
        if best is None:
            self._tell_failed(number, record, f"no evaluation recorded a finite {self.metric!r} (see "
                                              f"{layout.eval_dir(trial_dir.name, self.eval_name)}/metrics.jsonl)")
            return
        record.state, record.value, record.best_step, record.ended = "complete", best[0], best[1], time.time()
        record.write(trial_dir)
        self._set_attr(number, "best_step", best[1])
        if record.reason:
            self._set_attr(number, "stopped", record.reason)
        self.study.tell(number, best[0])
        stopped = f"; stopped early: {record.reason}" if record.reason else ""
        self.out(f"trial {number}: complete: {self.metric}={best[0]:.6g} (at step {best[1]} of {record.final_step})"
                 f"{stopped}")
        self._update_best()

    def _tell_failed(self, number: int, record: TrialRecord, error: str) -> None:
        optuna = self._optuna()
        record.state, record.error, record.ended = "failed", error, time.time()
        record.write(self.dir.trial_dir(number))
        self._set_attr(number, "error", error)
        self.study.tell(number, state=optuna.trial.TrialState.FAIL)
        self.out(f"trial {number}: FAILED: {error}  (log: {self.dir.trial_dir(number).name}/{TRIAL_LOG})")

    def _set_attr(self, number: int, key: str, value: Any) -> None:
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self._study_id, number)
        self.storage.set_trial_user_attr(trial_id, key, value)

    def _update_best(self) -> None:
        try:
            best = self.study.best_trial
        except ValueError:  # no complete trial yet
            return
        target = point_best(self.dir.best_link, self.dir.trial_dir(best.number))
        if best.number != self._best_number and target is not None:
            self.out(f"best so far: trial {best.number} ({self.metric}={best.value:.6g}): "
                     f"{self.dir.best_link.name} -> {target}")
            self._best_number = best.number

    # -- stopping --------------------------------------------------------------------------------

    def _stop_all(self, *, kill: bool) -> None:
        for process in self._running.values():
            if kill:
                _signal_group(process.proc.pid, signal.SIGKILL)
            elif process.kill_at is None:
                process.kill_at = time.monotonic() + self.options.grace_s
                _signal_group(process.proc.pid, signal.SIGTERM)

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for process in self._running.values():
            if process.kill_at is not None and now >= process.kill_at:
                self.out(f"trial {process.number}: still running {self.options.grace_s:g} s after SIGTERM; killing it")
                _signal_group(process.proc.pid, signal.SIGKILL)
                process.kill_at = math.inf

    def _wait_all(self) -> None:
        """Wait for the trial processes stopped by :meth:`_stop_all` (killing the overdue ones)."""
        while self._running:
            for number, process in list(self._running.items()):
                if process.proc.poll() is not None:
                    del self._running[number]
            self._kill_overdue()
            time.sleep(_POLL_S)

    def _result(self) -> SweepResult:
        counts: dict[str, int] = {}
        for trial in self.study.get_trials(deepcopy=False):
            counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
        best = None
        try:
            t = self.study.best_trial
            best = {"number": t.number, "value": t.value, "params": t.params,
                    "link": os.readlink(self.dir.best_link) if self.dir.best_link.is_symlink() else None}
        except ValueError:
            pass
        return SweepResult(counts=counts, best=best, stopped_by=self._signals[0] if self._signals else None)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
