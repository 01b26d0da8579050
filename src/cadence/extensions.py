"""What a user may implement to take part in a run: every extension point of cadence, in one place.

The :class:`~cadence.Controller` drives two *roles* and tells two kinds of *listeners*:

* :class:`Trainer` -- runs training steps and owns the global step; optionally
  :class:`Initializable` (a fresh start's ``initialize()``), :class:`GathersCheckpoint` (a
  collective before each save), :class:`ReportsSteps` (calls the controller after each optimizer
  step: what runs :meth:`Callback.on_train_step_end`), and a checkpoint protocol of
  :mod:`cadence.checkpoint.protocol` (``Checkpointable``, ``WritesShards``) to be saved.
* :class:`Evaluator` -- evaluates the current model state.
* an :data:`Action` -- any callable ``action(output: dict) -> Any`` (Orbit's contract), run on
  each inner loop's output (train actions) or each evaluation's metrics (eval actions).
* a :class:`Callback` -- told of the run's events (training started or ended, each step, a
  checkpoint committed or restored, an evaluation, the close), each hook with the run.
  A :class:`~cadence.trackers.Tracker` (MLflow, W&B, your own) is a Callback.

Actions and callbacks take part in the run's life cycle by being instances of the protocols below,
looked at by the controller in one place, never probed for one optional method at a time:

* :class:`RunAware` -- ``attach(run)``: handed the :class:`RunContext` once, when the controller is
  built, before the checkpoint is restored.
* :class:`Stateful` -- ``state_dict()`` / ``load_state_dict()`` (JSON): saved in every checkpoint
  under the object's position (``train_actions/<i>/<Class>``; :class:`NamedInCheckpoint`'s
  ``checkpoint_name`` replaces the class name) and restored with it.
* :class:`Closeable` -- ``close()``: an action closed once by ``Controller.close()`` (e.g. to put
  signal handlers back; a callback has ``on_close``).
* :class:`Composite` -- ``wrapped()``: an action that runs other actions
  (:class:`~cadence.actions.ConditionalAction`, :class:`~cadence.actions.PeriodicAction`). The
  controller attaches and closes what it wraps as it does the top-level objects, so a wrapper
  forwards nothing by hand; the wrapped objects' *state* is the wrapper's to save (it is part of
  the wrapper's ``state_dict``), so the checkpoint layout does not depend on how deep they sit.
* :class:`ChecksOutputs` -- ``check_outputs(metrics)``: an eval action that reads metrics by
  name checks, before training, that the evaluation's outputs hold them (the sanity check,
  :func:`cadence.loop.sanity.sanity_check`), so a misnamed metric fails before any step is trained.

No framework is imported here; ``cadence.torch`` implements the roles for PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from cadence.checkpoint import CheckpointManager
    from cadence.runtime.coordination import Coordinator

__all__ = ["Action", "Callback", "ChecksOutputs", "Closeable", "Composite", "EndsTraining", "Evaluator", "GathersCheckpoint",
           "Initializable", "JoinsPeers", "Logs", "NamedInCheckpoint", "PlansSteps", "ReportsSteps", "RunAware", "RunContext",
           "Stateful", "StepEnd", "Trainer"]

JSON = Any
Logs = Mapping[str, Any]
Action = Callable[[dict[str, Any]], Any]
StepEnd = Callable[[int], None]
"""What a :class:`ReportsSteps` trainer calls after each optimizer step, with the global step just completed."""


# -- the roles ---------------------------------------------------------------------------------


@runtime_checkable
class Trainer(Protocol):
    """Runs training steps and owns the global step (Orbit's ``AbstractTrainer``)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints)."""
        ...

    def train(self, num_steps: int) -> Logs | None:
        """Run up to ``num_steps`` steps; return the loop's logs (e.g. mean ``loss``).

        Returning after fewer steps means the training data is exhausted; the controller checks
        ``global_step`` to see how far it got.
        """
        ...


@runtime_checkable
class Evaluator(Protocol):
    """Evaluates the current model state (Orbit's ``AbstractEvaluator``)."""

    def evaluate(self, num_steps: int) -> Logs | None:
        """Evaluate ``num_steps`` batches (``-1``: until the eval data is exhausted); return metrics."""
        ...


@runtime_checkable
class Initializable(Protocol):
    """A runner with work to do on a fresh start (no checkpoint restored): pretrained weights and
    the like. Called once by the controller; an evaluator only when it runs alone."""

    def initialize(self) -> None: ...


@runtime_checkable
class GathersCheckpoint(Protocol):
    """A trainer that gathers state from every rank before a save (a collective on every rank,
    e.g. each rank's RNG state, for the chief to write)."""

    def prepare_checkpoint(self) -> None: ...


@runtime_checkable
class ReportsSteps(Protocol):
    """A trainer that reports each optimizer step: the extension point of
    :meth:`Callback.on_train_step_end`.

    The controller calls :meth:`set_step_end` once, when it is built: with the function that tells
    its per-step callbacks, or ``None`` when no callback overrides ``on_train_step_end`` (then
    the trainer pays nothing per step). A controller with a per-step callback and a trainer that
    is not ``ReportsSteps`` raises ``TypeError`` on construction."""

    def set_step_end(self, fn: StepEnd | None) -> None:
        """Call ``fn(global_step)`` after each optimizer step from now on (after the LR
        scheduler's step), on the training thread; ``None``: call nothing."""
        ...


@runtime_checkable
class EndsTraining(Protocol):
    """A trainer whose input can end as configured (``trainer.max_epochs``): once
    :attr:`training_ended` is true, a loop that advanced fewer steps than requested ends the run,
    as with ``train_steps=None``, instead of failing."""

    @property
    def training_ended(self) -> bool: ...


@runtime_checkable
class JoinsPeers(Protocol):
    """A trainer that may take a live peer's state mid-loop (a fault-tolerant replica group healing
    from another group): its global step then jumps to the peer's, and the loop ends at the step it
    was asked to reach (or one step past the peer's, if that is further). :attr:`loop_start_step` is
    where its last ``train`` call's steps are counted from (the jump included), so the controller
    counts that loop's steps, intervals and reports from there."""

    @property
    def loop_start_step(self) -> int: ...


@runtime_checkable
class PlansSteps(Protocol):
    """A trainer that knows where its input ends before training (``trainer.max_epochs`` epochs of
    an input with a length): with no step target (``train_steps=None``), or an earlier end than the
    target, :attr:`planned_steps` is the progress display's total (and so its ETA)."""

    @property
    def planned_steps(self) -> int | None:
        """The global step training ends at by the input's end; ``None``: unknown."""
        ...


# -- what actions and callbacks may use and be ---------------------------------------------------


class RunContext(Protocol):
    """What an action or a callback may use of the run it belongs to (the
    :class:`~cadence.Controller` is one). Read the step and rank facts; act through the methods."""

    @property
    def global_step(self) -> int:
        """The current global step (the trainer's; without one, the restored checkpoint's)."""
        ...

    @property
    def restored_step(self) -> int | None:
        """The step restored on construction; None before the restore or when none was."""
        ...

    @property
    def coordinator(self) -> Coordinator:
        """Rank facts (``rank``, ``world_size``, ``is_chief``) and the ranks' collectives."""
        ...

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The run's checkpoints (None: the run saves none)."""
        ...

    @property
    def trainer(self) -> Trainer | None:
        """The trainer (None: an evaluation-only run)."""
        ...

    @property
    def evaluator(self) -> Evaluator | None:
        """The evaluator (None: a training-only run)."""
        ...

    def save_checkpoint(self) -> str | None:
        """Collective: commit a checkpoint at the current step; its path (None: no manager)."""
        ...

    def rollback(self) -> int:
        """Collective: restore the model state of the latest checkpoint, keeping the data moving
        forward; the step rolled back to. Raises ``CheckpointError`` without one."""
        ...

    def request_stop(self, reason: str) -> None:
        """End training cleanly at the end of this inner loop (as raising ``StopTraining`` does)."""
        ...

    def prepare_checkpoint(self) -> None:
        """Collective: let the trainer gather from every rank what the chief saves."""
        ...

    def checkpoint_objects(self) -> dict[str, object]:
        """What a checkpoint of this run holds, by name (for actions that save elsewhere)."""
        ...


@runtime_checkable
class RunAware(Protocol):
    """Handed the run once, when the controller is built (before the restore)."""

    def attach(self, run: RunContext) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """JSON state saved in every checkpoint and restored from it (``state.json``)."""

    def state_dict(self) -> JSON: ...

    def load_state_dict(self, state: JSON) -> None: ...


@runtime_checkable
class NamedInCheckpoint(Protocol):
    """A :class:`Stateful` object saved under ``checkpoint_name`` rather than its class name
    (``None``: the class name), e.g. two of one class kept apart across reorderings."""

    checkpoint_name: str | None


@runtime_checkable
class Closeable(Protocol):
    """Closed once, by ``Controller.close()``."""

    def close(self) -> None: ...


@runtime_checkable
class Composite(Protocol):
    """An action that runs other actions: :meth:`wrapped` names them (and its condition's owner)."""

    def wrapped(self) -> Sequence[object]: ...


@runtime_checkable
class ChecksOutputs(Protocol):
    """An eval action that needs something in the evaluation's metrics (a metric by name)."""

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """Raise :class:`~cadence.errors.ConfigError` (or another
        :class:`~cadence.errors.CadenceError`) when this action could not run on ``metrics``: the
        message names what is missing and what the metrics hold. Changes nothing."""
        ...


def checkpoint_name(obj: object) -> str:
    """The name ``obj``'s state is saved under: its ``checkpoint_name`` when it is
    :class:`NamedInCheckpoint` and set, else its class name."""
    name = obj.checkpoint_name if isinstance(obj, NamedInCheckpoint) else None
    return name or type(obj).__name__


# -- callbacks -----------------------------------------------------------------------------------


class Callback:
    """Hooks called at the events of a run, each with the run (:class:`RunContext`); each is a
    no-op here (Determined's ``PyTorchCallback``, Lightning's callbacks, kept small).

    Subclass it and override the hooks you need, then pass instances as
    ``Controller(callbacks=[...])``, return them from ``Task.build_callbacks()``, or list them
    under ``callbacks:`` in the experiment config. The controller accepts ``Callback`` instances
    only (``TypeError`` otherwise) and calls every hook, in the order of the list.

    :meth:`attach` hands the callback the run once, on the controller's construction, before the
    checkpoint is restored. A callback that is also :class:`Stateful` (JSON-serialisable) is saved
    in every checkpoint, under ``callbacks/<i>/<ClassName>`` (``<i>``: its position in the
    controller's list; ``checkpoint_name`` replaces the class name when set), and restored from it
    -- only by a controller with a trainer, as for stateful actions.

    An exception raised by a hook propagates and ends the run, except from :meth:`on_close` (see
    there).

    Example -- write extra metadata into each committed checkpoint (Determined's ``RunHook``
    idea). The file is added after the commit, so it is not listed in ``MANIFEST.json``: restore
    and verification ignore it, and retention deletes it with its checkpoint::

        import json, os, socket, subprocess
        from cadence import Callback

        class WriteMetadata(Callback):
            def on_checkpoint_save(self, run, checkpoint_dir):
                commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
                meta = {"step": run.global_step, "git_commit": commit or None,
                        "hostname": socket.gethostname()}
                with open(os.path.join(checkpoint_dir, "metadata.json"), "w") as f:
                    json.dump(meta, f)

    (``checkpoint_dir`` is a local path for a local model dir; for an fsspec URL, write through
    ``fsspec.open``. With asynchronous checkpoints the hook may run after later steps were
    trained: take the step from ``os.path.basename(checkpoint_dir)`` (``ckpt-<step>``) there.)
    """

    def attach(self, run: RunContext) -> None:
        """Called once, when the controller is built (before the restore), with the run."""

    def on_train_start(self, run: RunContext) -> None:
        """Called at the start of ``Controller.train()`` and ``train_and_evaluate()``, after the
        checkpoint was restored (``run.global_step`` is the resumed step), on every rank."""

    def on_train_step_end(self, run: RunContext, step: int) -> None:
        """Called after each optimizer step (after the LR scheduler's step), on every rank, with
        the global step just completed (1 after the first step), on the training thread.

        Only for a callback whose class overrides it, decided when the controller is built: a run
        without one pays nothing per step. It needs a :class:`ReportsSteps` trainer
        (``TorchTrainer`` is one): ``TypeError`` on the controller's construction otherwise. Keep
        it small: it runs between two steps."""

    def on_train_end(self, run: RunContext) -> None:
        """Called when ``train()`` / ``train_and_evaluate()`` ends normally, on every rank: after
        the final checkpoint and ``FINAL`` were written (when the controller has a checkpoint
        manager), also after an action stopped training (:class:`~cadence.errors.StopTraining`),
        and after a preemption save-and-exit (:class:`~cadence.errors.PreemptedExit`, raised by
        :class:`~cadence.actions.SaveCheckpointIfPreempted` once its checkpoint is committed).
        Not called when training ends with any other exception."""

    def on_train_logs(self, run: RunContext, logs: dict[str, Any], step: int) -> None:
        """Called after each inner loop whose training summaries are due (every loop, or each
        ``summary_interval`` steps: when TensorBoard and ``metrics.jsonl`` get them), with the
        loop's output (losses, ``steps_per_second``) and the global step, on every rank (rank 0's
        summaries are the ones written)."""

    def on_checkpoint_save(self, run: RunContext, checkpoint_dir: str) -> None:
        """Called after a checkpoint was committed (its ``MANIFEST.json`` written), with its
        directory (a local path or an fsspec URL).

        Only on the chief (rank 0) of a multi-process job: the one process that writes
        checkpoints. With asynchronous checkpoints (``CheckpointManager(async_save=True)``) it is
        called on the training thread once the background commit has finished: at the end of the
        next inner loop, at the next save, at the end of training or in ``Controller.close()``,
        whichever comes first. Called once per commit, in commit order."""

    def on_checkpoint_load(self, run: RunContext, checkpoint_dir: str) -> None:
        """Called after a checkpoint was restored into the objects, with its directory, on every
        rank: the restore on construction, ``Controller.restore``, ``Controller.rollback`` (NaN
        recovery) and each checkpoint of ``evaluate_continuously``. Not called when there was
        nothing to restore."""

    def on_eval_end(self, run: RunContext, metrics: dict[str, Any], step: int) -> None:
        """Called after each ``Controller.evaluate()``, after its summaries were written and the
        eval actions ran, with the metrics and the evaluated global step, on every rank that
        evaluates."""

    def on_close(self, run: RunContext) -> None:
        """Called once, from ``Controller.close()`` (the end of a ``with controller:`` block),
        always: also after an exception or a preemption exit, on every rank.

        An exception raised here is logged and does not stop the other callbacks' ``on_close``;
        the first one is raised after all ran, unless an exception is already propagating
        (closing after a failure), which is never masked."""


def overrides_step_end(callback: Callback) -> bool:
    """Whether ``callback``'s class overrides :meth:`Callback.on_train_step_end`."""
    return type(callback).on_train_step_end is not Callback.on_train_step_end
