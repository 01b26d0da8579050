"""MLflow: one run per model dir (:class:`MLflowTracker`). Needs ``pip install 'cadence[mlflow]'``."""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from cadence.config.schema import MLflowConfig
from cadence.storage import local_path
from cadence.trackers.base import RECORDS_DIR, Tracker, default_run_name, flatten_params, require_extra

logger = logging.getLogger("cadence.trackers")

__all__ = ["MLflowTracker"]

DEFAULTS = MLflowConfig()  # the settings and their defaults live in the config section
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_MAX_PARAM = 6000  # MLflow's limit on a param value's length
REACH_TIMEOUT = 10.0
"""Seconds to wait for a tracking server to answer when the tracker starts."""


def _check_reachable(uri: str) -> None:
    """For a tracking server (``http(s)://``): one request to it, so a server that is down fails
    the tracker at once (one warning) rather than after MLflow's retries of every request. Any
    HTTP answer, an error status included, means it is up."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"MLflow tracking server {uri} unreachable: {reason}") from e


class MLflowTracker(Tracker):
    """Logs into an MLflow run through ``MlflowClient`` (no global ``mlflow.start_run`` state, so
    your own MLflow runs in the same process are left alone).

    Args:
      tracking_uri: the tracking store (``http://host:5000``, ``sqlite:///path.db``, ...).
        ``None``: the run record's (a run continued), else MLflow's default
        (``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the current directory).
      experiment: the experiment's name; created when missing.
      run_name: the run's name (``None``: the model dir's name, else MLflow's).
      tags: tags set on a new run.
      artifact_location: where the experiment keeps its runs' artifacts when this tracker creates
        it (a relative path is made absolute); ``None``: ``MODEL_DIR/trackers/mlflow`` with a local
        model dir and a local tracking store (not ``http(s)://``), else the store's default.
      model_dir: recorded as the run's tag ``cadence.model_dir``; the run of
        ``MODEL_DIR/trackers/mlflow.json`` is continued.
      settings: the other keywords of :class:`~cadence.trackers.Tracker` (``params``, ...).

    Raises:
      ConfigError: mlflow is not installed (names ``cadence[mlflow]``).
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = DEFAULTS.tracking_uri, experiment: str = DEFAULTS.experiment,
                 run_name: str | None = DEFAULTS.run_name, tags: Mapping[str, str] | None = None, *,
                 artifact_location: str | None = DEFAULTS.artifact_location, model_dir: str | None = None,
                 **settings: Any) -> None:
        require_extra("mlflow", "mlflow", "loggers.mlflow")
        super().__init__(model_dir=model_dir, **settings)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name if run_name is not None else default_run_name(model_dir)
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location
        self.client: Any = None
        self.run_id: str | None = None
        self._reopened_from: str | None = None

    def start(self, record: Mapping[str, Any] | None) -> dict[str, Any]:
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or (record or {}).get("tracking_uri") or mlflow.get_tracking_uri()
        _check_reachable(uri)
        self.client = MlflowClient(tracking_uri=uri)
        if record is not None:
            run = self.client.get_run(record["run_id"])
            if run.info.status != "RUNNING":  # running again; put back on close unless this process completes it
                self._reopened_from = run.info.status
                self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            tags = {**self.tags}
            if self.model_dir is not None:
                local = local_path(self.model_dir)
                tags.setdefault("cadence.model_dir", os.path.abspath(local) if local is not None else self.model_dir)
            run = self.client.create_run(self._experiment_id(uri), run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": uri}

    def _artifact_location(self, uri: str) -> str | None:
        """The artifact location of an experiment this tracker creates (see ``artifact_location``)."""
        location = self.artifact_location
        if location is not None:  # a plain path made absolute (MLflow would resolve it against the cwd); a URI as it is
            return os.path.abspath(location) if local_path(location) == location else location
        if uri.startswith(("http://", "https://", "databricks")) or self.model_dir is None:
            return None  # the server decides (its proxied artifact store)
        local = local_path(self.model_dir)
        return os.path.abspath(os.path.join(local, RECORDS_DIR, self.name)) if local is not None else None

    def _experiment_id(self, uri: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(self.experiment, artifact_location=self._artifact_location(uri)))
        except MlflowException:  # created meanwhile by another process
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return str(found.experiment_id)

    def discard(self) -> None:
        if self.run_id is not None:
            self.client.delete_run(self.run_id)
            self.run_id = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The flattened params; a continued run keeps the values it has (MLflow params never
        change) and gets the keys it lacks."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        flat = {k: str(v)[:_MAX_PARAM] for k, v in flatten_params(params).items()}
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        if changed:
            logger.info("mlflow: run %s keeps its first values of %s (MLflow params cannot change)", self.run_id,
                        ", ".join(changed))
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(new), 100):  # MLflow's limit of params per batch
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def log_metrics(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{prefix}/{k}" if prefix else k, float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _BATCH])

    def log_summary(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in values.items()])

    def log_artifact(self, path: str, name: str) -> None:
        if os.path.isdir(path):
            self.client.log_artifacts(self.run_id, path, name)
        else:
            self.client.log_artifact(self.run_id, path, name)

    def close(self, completed: bool) -> None:
        """``completed``: the run is marked FINISHED; otherwise a finished run this process
        reopened (a sidecar evaluating after the trainer ended) gets its status back."""
        if self.run_id is None:
            return
        if completed:
            self.client.set_terminated(self.run_id, "FINISHED")
        elif self._reopened_from is not None:
            self.client.set_terminated(self.run_id, self._reopened_from)
