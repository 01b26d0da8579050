"""Life-cycle hooks of a :class:`~cadence.Controller` run: :class:`Callback`.

Actions (:mod:`cadence.actions`) react to each inner loop's output; callbacks are told about the
run's *events*: training started or ended, a checkpoint was committed or restored, an evaluation
finished, the controller closed. They are modelled on Determined's ``PyTorchCallback`` and
Lightning's callbacks, kept small. No hook runs per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from cadence.lifecycle import RunContext

__all__ = ["Callback"]


class Callback:
    """Hooks called by a :class:`~cadence.Controller` at the events of a run; each is a no-op here.

    Subclass it and override the hooks you need, then pass instances as
    ``Controller(callbacks=[...])``, return them from ``Task.build_callbacks()``, or list them
    under ``callbacks:`` in the experiment config. The controller accepts ``Callback`` instances
    only (``TypeError`` otherwise) and calls every hook.

    :meth:`attach` hands the callback the run (a :class:`~cadence.lifecycle.RunContext`: global
    step, rank facts, the checkpoint manager) once, on the controller's construction, before the
    checkpoint is restored. A callback that also defines ``state_dict()`` /
    ``load_state_dict(state)`` (JSON-serialisable; the :class:`~cadence.checkpoint.Stateful`
    protocol) is saved in every checkpoint, under ``callbacks/<i>/<ClassName>`` (``<i>``: its
    position in the controller's list; ``checkpoint_name`` replaces the class name when set), and
    restored from it -- only by a controller with a trainer, as for stateful actions.

    An exception raised by a hook propagates and ends the run, except from :meth:`on_close` (see
    there).

    Example -- write extra metadata into each committed checkpoint (Determined's ``RunHook``
    idea). The file is added after the commit, so it is not listed in ``MANIFEST.json``: restore
    and verification ignore it, and retention deletes it with its checkpoint::

        import json, os, socket, subprocess
        from cadence import Callback

        class WriteMetadata(Callback):
            def attach(self, run):
                self.run = run

            def on_checkpoint_save(self, checkpoint_dir):
                commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
                meta = {"step": self.run.global_step, "git_commit": commit or None,
                        "hostname": socket.gethostname()}
                with open(os.path.join(checkpoint_dir, "metadata.json"), "w") as f:
                    json.dump(meta, f)

    (``checkpoint_dir`` is a local path for a local model dir; for an fsspec URL, write through
    ``fsspec.open``. With asynchronous checkpoints the hook may run after later steps were
    trained: take the step from ``os.path.basename(checkpoint_dir)`` (``ckpt-<step>``) there.)
    """

    def attach(self, run: RunContext) -> None:
        """Called once, when the controller is built (before the restore), with the run."""

    def on_train_start(self) -> None:
        """Called at the start of ``Controller.train()`` and ``train_and_evaluate()``, after the
        checkpoint was restored (``controller.global_step`` is the resumed step), on every rank."""

    def on_train_end(self) -> None:
        """Called when ``train()`` / ``train_and_evaluate()`` ends normally, on every rank: after
        the final checkpoint and ``FINAL`` were written (when the controller has a checkpoint
        manager), also after an action stopped training (:class:`~cadence.errors.StopTraining`),
        and after a preemption save-and-exit (:class:`~cadence.errors.PreemptedExit`, raised by
        :class:`~cadence.actions.SaveCheckpointIfPreempted` once its checkpoint is committed).
        Not called when training ends with any other exception."""

    def on_train_logs(self, logs: dict[str, Any], step: int) -> None:
        """Called after each inner loop whose training summaries are due (every loop, or each
        ``summary_interval`` steps: when TensorBoard and ``metrics.jsonl`` get them), with the
        loop's output (losses, ``steps_per_second``) and the global step, on every rank (rank 0's
        summaries are the ones written)."""

    def on_checkpoint_save(self, checkpoint_dir: str) -> None:
        """Called after a checkpoint was committed (its ``MANIFEST.json`` written), with its
        directory (a local path or an fsspec URL).

        Only on the chief (rank 0) of a multi-process job: the one process that writes
        checkpoints. With asynchronous checkpoints (``CheckpointManager(async_save=True)``) it is
        called on the training thread once the background commit has finished: at the end of the
        next inner loop, at the next save, at the end of training or in ``Controller.close()``,
        whichever comes first. Called once per commit, in commit order."""

    def on_checkpoint_load(self, checkpoint_dir: str) -> None:
        """Called after a checkpoint was restored into the objects, with its directory, on every
        rank: the restore on construction, :meth:`Controller.restore`,
        :meth:`Controller.rollback` (NaN recovery) and each checkpoint of
        ``evaluate_continuously``. Not called when there was nothing to restore."""

    def on_eval_end(self, metrics: dict[str, Any], step: int) -> None:
        """Called after each ``Controller.evaluate()``, after its summaries were written and the
        eval actions ran, with the metrics and the evaluated global step, on every rank that
        evaluates."""

    def on_close(self) -> None:
        """Called once, from ``Controller.close()`` (the end of a ``with controller:`` block),
        always: also after an exception or a preemption exit, on every rank.

        An exception raised here is logged and does not stop the other callbacks' ``on_close``;
        the first one is raised after all ran, unless an exception is already propagating
        (closing after a failure), which is never masked."""
