"""Weights & Biases: one run per model dir (:class:`WandbTracker`). Needs ``pip install 'cadence[wandb]'``."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from cadence.config.schema import WandbConfig
from cadence.storage import local_path
from cadence.trackers.base import Tracker, default_run_name, require_extra

__all__ = ["STEP_KEY", "WandbTracker"]

DEFAULTS = WandbConfig()  # the settings and their defaults live in the config section
STEP_KEY = "global_step"
"""The x-axis of every metric: W&B's own ``_step`` must only grow, and a sidecar logs evaluations
of steps the trainer has passed; each record carries the global step under this key instead."""


class WandbTracker(Tracker):
    """Logs into a W&B run (``wandb.init(id=..., resume="allow")``), ``offline`` by default: no
    network or account needed; ``wandb sync DIR/wandb/offline-run-*`` uploads it later.

    Args:
      project, entity: where the run goes (``entity`` None: your default).
      mode: ``offline``, ``online`` or ``disabled``.
      dir: where W&B writes (``DIR/wandb/``); ``None``: ``MODEL_DIR/trackers`` for a local model
        dir, else the current directory.
      run_name, tags: the run's name (``None``: the model dir's name, else W&B's) and tags.
      model_dir: the model dir (for ``dir``'s default); the run of ``MODEL_DIR/trackers/wandb.json``
        is continued.
      settings: the other keywords of :class:`~cadence.trackers.Tracker` (``params``, ...).

    Each process of the model dir (the trainer, a resumed trainer, a sidecar) logs under the one
    run id of ``MODEL_DIR/trackers/wandb.json``; offline, each writes an ``offline-run-*-<id>``
    directory of that id.

    Raises:
      ConfigError: wandb is not installed (names ``cadence[wandb]``).
    """

    name = "wandb"

    def __init__(self, project: str = DEFAULTS.project, entity: str | None = DEFAULTS.entity,
                 mode: Literal["offline", "online", "disabled"] = DEFAULTS.mode, dir: str | None = DEFAULTS.dir,
                 run_name: str | None = DEFAULTS.run_name, tags: list[str] | None = None, *,
                 model_dir: str | None = None, **settings: Any) -> None:
        require_extra("wandb", "wandb", "loggers.wandb")
        super().__init__(model_dir=model_dir, **settings)
        self.project = project
        self.entity = entity
        self.mode = mode
        local = local_path(model_dir) if model_dir is not None else None
        if dir is None and local is not None:
            dir = os.path.join(local, "trackers")
        self.dir = dir
        self.run_name = run_name if run_name is not None else default_run_name(model_dir)
        self.tags = list(tags or [])
        self.run_id: str | None = None
        self.run: Any = None

    def start(self, record: Mapping[str, Any] | None) -> dict[str, Any]:
        """Takes a run id (the record's, or a new one); W&B starts at the first call that logs."""
        self.run_id = str(record["run_id"]) if record is not None else secrets.token_hex(4)
        return {"run_id": self.run_id, "project": self.project, "entity": self.entity}

    def discard(self) -> None:
        self.run_id = None  # nothing was started yet

    def _open(self) -> Any:
        if self.run is None:
            import wandb

            if self.dir is not None:
                os.makedirs(self.dir, exist_ok=True)
            self.run = wandb.init(
                project=self.project, entity=self.entity, id=self.run_id, resume="allow", mode=self.mode,
                dir=self.dir, name=self.run_name, tags=self.tags or None,
                settings=wandb.Settings(reinit="create_new", console="off"),
            )
            self.run.define_metric(STEP_KEY)
            self.run.define_metric("*", step_metric=STEP_KEY)
        return self.run

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._open().config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        values: dict[str, Any] = {f"{prefix}/{k}" if prefix else k: float(v) for k, v in metrics.items()}
        self._open().log({**values, STEP_KEY: int(step)})

    def log_summary(self, values: Mapping[str, Any]) -> None:
        self._open().summary.update(dict(values))

    def log_artifact(self, path: str, name: str) -> None:
        """An artifact of type ``model`` named after ``name`` (``export/final/600``: ``export-final``
        with the alias ``step-600``): each export a new version of it."""
        import wandb

        base, _, last = name.rpartition("/")
        aliases = [f"step-{last}"] if base and last.isdigit() else []
        base = base if aliases else name
        artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-") or "artifact", type="model",
                                  metadata={"path": name})
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        self._open().log_artifact(artifact, aliases=aliases or None)

    def close(self, completed: bool) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
