"""Keep the best checkpoint in ``MODEL_DIR/best/`` (TF Model Garden's ``BestCheckpointExporter``,
tf.estimator's ``BestExporter``) -- without tf.estimator's bug of exporting a worse model after a
restart (tensorflow#47396)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Mapping

from cadence.actions.best_metric import NewBestMetric
from cadence.actions.metric_path import Metric, check_metric, is_better, metric_name
from cadence.checkpoint import CheckpointManager, JSONState, copy_objects
from cadence.checkpoint.protocol import WritesShards
from cadence.checkpoint.space import raise_if_full
from cadence.errors import CheckpointError
from cadence.extensions import RunContext
from cadence.summaries.scalars import json_value

logger = logging.getLogger("cadence.actions")

BEST_JSON = "best.json"
RECORD = "best"  # the name of the best record inside the best checkpoint's state.json

ExportFn = Callable[[int, Mapping[str, Any]], Any]


def _jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-representable scalar metrics (see :func:`cadence.summaries.scalars.json_value`),
    nested ones (named splits) flattened to ``a/b`` keys as in ``metrics.jsonl``."""
    values: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            values.update({f"{key}/{k}": v for k, v in _jsonable(value).items()})
        else:
            values[key] = json_value(value)
    return {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str)) or v is None}


class BestCheckpointExporter:
    """An eval action: when ``metric`` improves, the checkpoint of that step becomes ``best/``.

    ``best_dir`` (normally ``MODEL_DIR/best``) holds one committed checkpoint
    (``best/ckpt-<step>/``, written through the same commit protocol as every checkpoint, so a
    crash never leaves a half-written best) whose ``state.json`` records the best (``metric``,
    ``value``, ``step``, all eval ``metrics``), plus ``best/best.json`` with the same record for
    people and tools. Retention of ``checkpoints/`` never touches ``best/``.

    The checkpoint copied is the committed one at the evaluated step when it exists (the sidecar
    case); otherwise the controller's live state is saved (in-process evaluation, which runs
    before the step's own checkpoint is written).

    **Restarts.** The best value is read back from the committed best checkpoint when the action
    is built, so a restarted run (or sidecar) never replaces a better model with a worse one; an
    equal value is not an improvement. The new best is committed before the old one is deleted;
    after a crash between the two, the better-valued record wins. A step that is already the
    best, re-evaluated with a better score, keeps its record (it is the same model).

    Args:
      best_dir: where the best checkpoint lives (local path or fsspec URL).
      metric: the eval metric (a key, ``"a/b"`` for a nested one, or a callable).
      higher_is_better: direction of improvement.
      export_fn: called as ``export_fn(step, record)`` after a new best is committed, e.g. to
        write inference artefacts to ``export/best/<step>/``; on every rank (the decision is
        the same on all): a sharded model's export gathers its state, a collective, and the
        chief writes.
    """

    def __init__(
        self,
        best_dir: str,
        metric: Metric,
        higher_is_better: bool = True,
        *,
        export_fn: ExportFn | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.best_dir = best_dir
        self.export_fn = export_fn
        # Retention is done here, not by step order: a new best can be at a lower step than the
        # old one (a resumed run re-evaluating), so "keep the newest step" would keep the wrong one.
        self.manager = CheckpointManager(best_dir, max_to_keep=None, storage_options=storage_options)
        self._best = NewBestMetric(metric, higher_is_better)
        self._run: RunContext | None = None
        self._chief = True
        self.record = self._read_record()
        if self.record is not None:
            self._best.load_state_dict(
                {"best_value": self.record["value"], "metric": self.record["metric"],
                 "higher_is_better": higher_is_better}
            )
            self._write_best_json(self.record)  # in case a crash came between commit and best.json

    @property
    def best_value(self) -> float | None:
        return self._best.best_value

    def attach(self, run: RunContext) -> None:
        self._run = run
        self._chief = run.coordinator.is_chief
        if run.checkpoint_manager is not None:  # best/ is committed under the run's writer lease too
            self.manager.fence = run.checkpoint_manager.fence
            self.manager.checksum = run.checkpoint_manager.checksum

    def check_outputs(self, metrics: Mapping[str, Any]) -> None:
        """ConfigError when ``metrics`` hold no number under the metric (names the keys they hold)."""
        check_metric(metrics, self._best.metric, "BestCheckpointExporter")

    def _read_record(self) -> dict[str, Any] | None:
        """The record of the best-valued committed checkpoint in ``best/`` (normally the only one;
        a crash between committing a new best and deleting the old one leaves two)."""
        records = []
        for step in self.manager.steps():
            record = self.manager.read_state(step)["state"].get(RECORD)
            if not isinstance(record, dict) or not isinstance(record.get("value"), (int, float)):
                raise CheckpointError(f"{self.manager.path(step)} has no best record in its state.json")
            records.append(record)
        best: dict[str, Any] | None = None
        for record in records:
            reference = None if best is None else best["value"]
            if is_better(record["value"], reference, higher_is_better=self._best.higher_is_better):
                best = record
        return best

    def __call__(self, metrics: dict[str, Any]) -> bool:
        """Commit ``best/`` when ``metrics`` hold a new best; return whether they did."""
        run = self._run
        if run is None:
            raise RuntimeError("BestCheckpointExporter must be attached to a Controller (pass it in eval_actions)")
        if not self._best.test(metrics):
            return False
        step = run.global_step
        value = self._best.metric_value(metrics)
        if self.record is not None and self.record["step"] == step:
            # The same step re-evaluated with a better score: the same model, already in best/.
            # Its committed record is kept, so what a restart reads back never changes.
            logger.info("step %d re-evaluated at %s=%.6g, better than its recorded %.6g: best/ keeps the record",
                        step, self.record["metric"], value, self.record["value"])
            return False
        record = {
            "metric": metric_name(self._best.metric),
            "value": value,
            "higher_is_better": self._best.higher_is_better,
            "step": step,
            "metrics": _jsonable(metrics),
            "time": time.time(),
        }
        objects = self._checkpoint_objects(run, step)  # collective with live state (all ranks)
        if self._chief:  # every rank took the same decision (metrics are reduced over ranks)
            objects[RECORD] = JSONState(record)
            path = self.manager.save(step, objects)
            for old in self.manager.steps():
                if old != step:
                    self.manager.delete(old)
            self._write_best_json(record)
            logger.info("new best %s=%.6g at step %d: %s", record["metric"], value, step, path)
        if self.export_fn is not None:
            self.export_fn(step, record)
        self._best.commit(metrics)
        self.record = record
        run.coordinator.barrier()
        return True

    def _checkpoint_objects(self, run: RunContext, step: int) -> dict[str, object]:
        """Collective: what ``best/`` commits at ``step`` (on the chief; ``{}`` elsewhere): a copy of
        the run's checkpoint of ``step``, else the trainer's live state. A trainer whose
        checkpoints are sharded commits the run's checkpoint first (every rank writes its shards),
        then it is copied."""
        source = run.checkpoint_manager
        # The chief decides for all: an asynchronous commit may land between the ranks' listings.
        committed = run.coordinator.broadcast(source is not None and step in source.steps())
        if not committed and source is not None and isinstance(run.trainer, WritesShards) and run.trainer.writes_shards:
            run.save_checkpoint()
            committed = True
        if committed and source is not None:
            if not self._chief:
                return {}
            source.wait()  # an asynchronous commit of the step
            reader, state = source.read(step)
            return copy_objects(reader, state)
        if run.trainer is None:
            raise CheckpointError(
                f"no committed checkpoint at step {step} to copy to {self.best_dir}, and no trainer state to save"
            )
        run.prepare_checkpoint()
        return dict(run.checkpoint_objects())

    def _write_best_json(self, record: Mapping[str, Any]) -> None:
        storage = self.manager.storage
        try:
            storage.write_atomic(storage.join(BEST_JSON), (json.dumps(record, indent=1) + "\n").encode())
        except OSError as e:
            raise_if_full(e, storage, f"write {BEST_JSON} for step {record['step']}")
            raise


def read_best_record(best_dir: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The record of ``best_dir``'s ``best.json`` (the best checkpoint's ``metric``, ``value``,
    ``step``, eval ``metrics``; see :class:`BestCheckpointExporter`); None when there is none.

    Raises ValueError when the file is not JSON or holds no integer ``step`` (OSError when it
    cannot be read)."""
    from cadence.storage import Storage

    storage = Storage(best_dir, storage_options)
    try:
        data = storage.read_bytes(storage.join(BEST_JSON))
    except FileNotFoundError:
        return None
    record = json.loads(data)
    if not isinstance(record, dict) or isinstance(record.get("step"), bool) or not isinstance(record.get("step"), int):
        raise ValueError("no integer step in it")
    return record
