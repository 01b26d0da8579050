"""The sidecar evaluator: :class:`SidecarEvaluator` (Keras' ``SidecarEvaluator``, tf.estimator's
evaluator role).

It runs :class:`~cadence.sidecar.continuous.ContinuousEvaluation` (the loop under
``Controller.evaluate_continuously`` too) in a separate process and adds what a separate process
needs: leases, so the trainer's retention never deletes a checkpoint from under it;
``evaluations.jsonl``, so a restarted sidecar never evaluates a step twice; and SIGTERM handling.
:meth:`SidecarEvaluator.backfill` runs the same loop over a fixed list of checkpoints
(:mod:`cadence.sidecar.backfill`).

Framework-agnostic: the evaluator is any :class:`~cadence.extensions.Evaluator` that restores
checkpoints (``cadence.torch.experiments.experiment.build_sidecar`` builds one for a Task).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Iterable, Iterator, Literal, Sequence

from cadence import layout
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.lease_file import clock_skew
from cadence.checkpoint.lease_keeper import LeaseKeeper
from cadence.checkpoint.leases import Leases
from cadence.errors import ReaderLeaseHeldError
from cadence.extensions import Evaluator
from cadence.loop.controller import Controller
from cadence.runtime.coordination import Coordinator
from cadence.runtime.signals import install_handlers
from cadence.sidecar.backfill import Backfill, backfill_plan
from cadence.sidecar.continuous import (DEFAULTS, EVALUATIONS_FILE, BestTracker, ContinuousEvaluation, EvaluationLog,
                                        SidecarResult, resume_after)
from cadence.sidecar.external import ReportsExternal
from cadence.sidecar.ranks import ChiefRun, follow

__all__ = ["EVALUATIONS_FILE", "EvaluationLog", "SidecarEvaluator", "SidecarResult", "check_backfill", "check_name_free",
           "lease_holder"]


def lease_holder(name: str | None = None) -> str:
    """The lease holder name of the sidecar called ``name`` (``sidecar-eval`` for the default)."""
    return f"sidecar-{name or 'eval'}"


def check_name_free(model_dir: str, name: str | None = None, *, storage_options: dict[str, Any] | None = None) -> None:
    """:class:`~cadence.errors.ReaderLeaseHeldError` when another live process (a sidecar or a
    backfill) evaluates ``model_dir`` under ``name``: it holds the lease :func:`lease_holder`
    (:meth:`~cadence.checkpoint.leases.Leases.held_elsewhere`: a lease left by a process that died
    on this host does not count; one of another host counts until it lapses, ``lease_ttl`` after
    its last renewal). A check, not a lock: two started at the same instant both pass."""
    leases = Leases(layout.checkpoints_dir(model_dir), storage_options=storage_options)
    holder = lease_holder(name)
    lease = leases.held_elsewhere(holder)
    if lease is not None:
        lapses = max(0.0, lease.expires + clock_skew(lease.host) - time.time())
        raise ReaderLeaseHeldError(
            f"another evaluator runs as {holder!r} on {model_dir}: pid {lease.pid} on host {lease.host or '?'} "
            f"holds its lease {leases.path(holder)} (it lapses {lapses:.0f}s after its last renewal); wait for it "
            "to end, or evaluate under another name")


def check_backfill(model_dir: str, name: str | None = None, checkpoints: Sequence[int] | None = None, *,
                   storage_options: dict[str, Any] | None = None) -> None:
    """The bad input of a backfill of ``model_dir``'s evaluation ``name``, found before anything is
    built or written: :class:`~cadence.errors.NoCheckpointError` for a step of ``checkpoints``
    neither committed nor recorded, or (None) nothing committed
    (:func:`~cadence.sidecar.backfill.backfill_plan`); :class:`~cadence.errors.ReaderLeaseHeldError`
    when another live process evaluates under ``name`` (:func:`check_name_free`)."""
    manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False, storage_options=storage_options)
    backfill_plan(manager, EvaluationLog(layout.eval_dir(model_dir, name), storage_options).records(), checkpoints)
    check_name_free(model_dir, name, storage_options=storage_options)


class SidecarEvaluator:
    """Evaluates the committed checkpoints of ``model_dir`` while a trainer writes them.

    Args:
      evaluator: an :class:`~cadence.extensions.Evaluator` that restores checkpoints
        (``load_checkpoint``); for a ``cadence.torch.Task``, use
        ``cadence.torch.experiments.experiment.build_sidecar``.
      model_dir: the trainer's model dir (local path or fsspec URL), shared with the trainer.
      steps: batches per evaluation; ``-1``: the whole eval data.
      mode, max_evaluations, timeout, poll_interval, name, max_pending, lease_ttl, max_retries,
        retry_backoff: the ``sidecar:`` settings, with their defaults and meaning from
        :class:`~cadence.config.SidecarConfig` (``mode="every"`` evaluates each committed
        checkpoint in step order, ``"latest"`` jumps to the newest; ``max_evaluations`` counts
        restarts too, as recorded in ``evaluations.jsonl``; ``name`` writes to ``eval_<name>/``
        and holds the lease ``sidecar-<name>``: one sidecar or backfill per name and model dir,
        another one is refused, :meth:`check_name`).
      eval_actions: actions run on each evaluation's metrics (e.g. ``BestCheckpointExporter``).
      train_steps: a checkpoint at or past this step is final even before ``FINAL`` appears.
      best_metric / higher_is_better: the metric whose best is reported (and rebuilt from
        ``evaluations.jsonl`` on restart). ``None``: no best is tracked here.
      callbacks: :class:`~cadence.extensions.Callback` objects told of each checkpoint restored
        (``on_checkpoint_load``), each evaluation (``on_eval_end``) and the end (``on_close``,
        always). A sidecar does not train: ``on_train_start`` / ``on_train_end`` /
        ``on_checkpoint_save`` never fire, and callbacks' state is not restored (it belongs to
        the training run).
      coordinator: the ranks of a sidecar of several processes (``None``: one). The chief alone
        watches, holds the lease and writes ``evaluations.jsonl``; every rank restores and
        evaluates each checkpoint it picks (:mod:`cadence.sidecar.ranks`).

    The stop conditions, each with a clear message: the final checkpoint was evaluated
    (``checkpoints/FINAL``, or a step >= ``train_steps``); ``max_evaluations``; ``timeout``
    seconds with no new checkpoint; SIGTERM/SIGINT (the current evaluation finishes first).
    """

    def __init__(
        self,
        evaluator: Evaluator,
        model_dir: str,
        mode: Literal["every", "latest"] = DEFAULTS.mode,
        steps: int = -1,
        max_evaluations: int | None = DEFAULTS.max_evaluations,
        timeout: float | None = DEFAULTS.timeout,
        poll_interval: float = DEFAULTS.poll_interval,
        name: str | None = DEFAULTS.name,
        eval_actions: Iterable[Any] = (),
        *,
        train_steps: int | None = None,
        max_pending: int | None = DEFAULTS.max_pending,
        lease_ttl: float = DEFAULTS.lease_ttl,
        max_retries: int = DEFAULTS.max_retries,
        retry_backoff: float = DEFAULTS.retry_backoff,
        best_metric: str | None = None,
        higher_is_better: bool = True,
        storage_options: dict[str, Any] | None = None,
        callbacks: Iterable[Any] = (),
        coordinator: Coordinator | None = None,
    ) -> None:
        if mode not in ("every", "latest"):
            raise ValueError(f"mode must be 'every' or 'latest', got {mode!r}")
        if max_evaluations is not None and max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1 or None, got {max_evaluations}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        if not isinstance(evaluator, Evaluator):
            raise TypeError(f"SidecarEvaluator needs an evaluator (evaluate(num_steps)), got {type(evaluator).__name__}; "
                            "for a Task use cadence.torch.experiments.experiment.build_sidecar")
        self.evaluator = evaluator
        self.model_dir = model_dir
        self.mode = mode
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.name = name
        self.eval_actions = list(eval_actions)
        self.callbacks = list(callbacks)
        self.train_steps = train_steps
        self.max_pending = max_pending
        self.lease_ttl = lease_ttl
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.best = BestTracker(best_metric, higher_is_better)
        self.holder = lease_holder(name)
        self.eval_dir = layout.eval_dir(model_dir, name)
        self.manager = CheckpointManager(layout.checkpoints_dir(model_dir), writer=False,
                                         storage_options=storage_options)
        self.leases = Leases(layout.checkpoints_dir(model_dir), storage_options=storage_options)
        self.log = EvaluationLog(self.eval_dir, storage_options)
        self.storage_options = storage_options
        self.coordinator = coordinator
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask :meth:`start` to return after the current evaluation (thread- and signal-safe)."""
        self._stop.set()

    def start(self) -> SidecarResult:
        """Evaluate checkpoints until a stop condition; return what was done and why it stopped.
        With a coordinator of several ranks, on every rank: the chief leads, the others follow
        (:mod:`cadence.sidecar.ranks`), and every rank returns the chief's result.

        Raises :class:`~cadence.errors.ReaderLeaseHeldError` first (on the chief; the other ranks raise
        too) when another live process evaluates under this name (:meth:`check_name`)."""
        controller = self._controller()
        if self.coordinator is None or self.coordinator.world_size == 1:
            return self._lead(controller, None)
        if not self.coordinator.is_chief:
            return self._follow(controller)
        run = ChiefRun(controller, self.coordinator)
        try:
            result = self._lead(controller, run)
        except BaseException as e:
            run.fail(e)  # the others raise too, rather than wait for a command that never comes
            raise
        run.end(result)
        return result

    def _lead(self, controller: Controller, run: ChiefRun | None) -> SidecarResult:
        """The sidecar's loop, its lease and its log (one process, or the chief of several ranks,
        whose restores and evaluations ``run`` broadcasts); closes ``controller``."""
        try:
            self.check_name()
        except BaseException:
            controller.close()
            raise
        after = resume_after({r["step"] for r in self.log.records()}, self.manager.steps(), self.mode)
        every = self.mode == "every"
        # every: protect all checkpoints after the last one dealt with (-1: all of them)
        with self._session(controller, after=(-1 if after is None else after) if every else None,
                           max_pending=self.max_pending if every else None) as keeper:
            return ContinuousEvaluation(
                run or controller, steps=self.steps, mode=self.mode, poll_interval=self.poll_interval,
                timeout=self.timeout, max_evaluations=self.max_evaluations, train_steps=self.train_steps,
                max_retries=self.max_retries, retry_backoff=self.retry_backoff, log=self.log, keeper=keeper,
                max_pending=self.max_pending, best=self.best, name=self.holder, external=self._external(),
                should_stop=run.should_stop(self._stop.is_set) if run else self._stop.is_set,
            ).run()

    def backfill(self, checkpoints: Sequence[int] | None = None) -> SidecarResult:
        """Evaluate the committed checkpoints (``checkpoints``: these steps; None: every one
        committed now) that have no record in this name's ``evaluations.jsonl``, oldest first,
        then stop (:class:`~cadence.sidecar.backfill.Backfill`: stop reason ``"backfilled"``, or
        ``"stopped"`` on SIGTERM/SIGINT after the current evaluation). Same records, best and eval
        actions as :meth:`start`; ``mode``, ``timeout``, ``max_evaluations`` and ``max_pending``
        do not apply. Under this name's lease, protecting only the checkpoint it reads.

        Raises, before anything is written: :class:`~cadence.errors.NoCheckpointError` for a step
        neither committed nor recorded, or nothing committed
        (:func:`check_backfill`); :class:`~cadence.errors.ReaderLeaseHeldError` as :meth:`start`.
        """
        check_backfill(self.model_dir, self.name, checkpoints, storage_options=self.storage_options)
        controller = self._controller()
        with self._session(controller, after=None, max_pending=None) as keeper:
            return Backfill(controller, checkpoints, steps=self.steps, max_retries=self.max_retries,
                            retry_backoff=self.retry_backoff, log=self.log, keeper=keeper, best=self.best,
                            should_stop=self._stop.is_set, name=f"{self.holder} (backfill)",
                            external=self._external()).run()

    def _external(self) -> ReportsExternal | None:
        """The evaluator, when it runs external evaluators (their outcomes go into each record)."""
        return self.evaluator if isinstance(self.evaluator, ReportsExternal) else None

    def check_name(self) -> None:
        """:class:`~cadence.errors.ReaderLeaseHeldError` when another live process (a sidecar or a
        backfill) holds this name's lease (:func:`check_name_free`)."""
        check_name_free(self.model_dir, self.name, storage_options=self.storage_options)

    def _controller(self) -> Controller:
        """The controller restoring and evaluating checkpoints (its collectives on the coordinator's
        ranks, when there are several)."""
        return Controller(evaluator=self.evaluator, checkpoint_manager=self.manager, eval_summary_dir=self.eval_dir,
                          eval_actions=self.eval_actions, callbacks=self.callbacks, restore=False, progress=False,
                          coordinator=self.coordinator)

    @contextlib.contextmanager
    def _session(self, controller: Controller, *, after: int | None, max_pending: int | None) -> Iterator[LeaseKeeper]:
        """This name's lease kept fresh (``after``, ``max_pending``: its range) and SIGTERM/SIGINT
        asking :meth:`stop`, while ``controller`` runs; on exit the lease is released and
        ``controller`` closed."""
        try:
            keeper = LeaseKeeper(self.leases, self.holder, ttl=self.lease_ttl, after=after,
                                 max_pending=max_pending).start()
        except BaseException:
            controller.close()
            raise
        handlers = install_handlers((signal.SIGTERM, signal.SIGINT), lambda *_: self.stop(), owner=self.holder)
        try:
            yield keeper
        finally:
            keeper.close()
            controller.close()
            handlers.restore()

    def _follow(self, controller: Controller) -> SidecarResult:
        """A rank other than the chief: restore and evaluate what the chief picks; no lease, no log."""
        assert self.coordinator is not None
        handlers = install_handlers((signal.SIGTERM, signal.SIGINT), lambda *_: self.stop(), owner=self.holder)
        try:
            return follow(controller, self.coordinator, self._stop.is_set)
        finally:
            controller.close()
            handlers.restore()
