"""Callbacks and a Task for the callback end-to-end tests, loaded by path from a config
(``tests/callback_tasks.py:EventLog``). Each event is appended to a JSON-lines file at once, so a
test can watch a running ``cadence train`` and read what happened after it was killed."""

from __future__ import annotations

import json
import os
from typing import Any

from tasks import TinyTask

from cadence import Callback


class EventLog(Callback):
    """Appends ``{"tag", "event", ...}`` to ``path`` at every hook."""

    def __init__(self, path: str, tag: str = "config") -> None:
        self.path = path
        self.tag = tag

    def _log(self, event: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"tag": self.tag, "event": event, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def attach(self, run: Any) -> None:
        self._log("attach")

    def on_train_start(self, run: Any) -> None:
        self._log("train_start", step=run.global_step)

    def on_train_end(self, run: Any) -> None:
        self._log("train_end", step=run.global_step)

    def on_checkpoint_save(self, run: Any, checkpoint_dir: str) -> None:
        self._log("checkpoint_save", dir=os.path.basename(checkpoint_dir),
                  manifest=os.path.exists(os.path.join(checkpoint_dir, "MANIFEST.json")))

    def on_checkpoint_load(self, run: Any, checkpoint_dir: str) -> None:
        self._log("checkpoint_load", dir=os.path.basename(checkpoint_dir))

    def on_eval_end(self, run: Any, metrics: dict, step: int) -> None:
        self._log("eval_end", step=step)

    def on_close(self, run: Any) -> None:
        self._log("close")


class EvalMetricsLog(Callback):
    """Appends ``{"step", "metrics"}`` to ``path`` at each ``on_eval_end`` (the numbers a tracker gets)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_eval_end(self, run: Any, metrics: dict, step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


class TaskWithCallbacks(TinyTask):
    """TinyTask whose ``build_callbacks`` returns an :class:`EventLog` tagged ``task``."""

    def __init__(self, events: str, **params: Any) -> None:
        super().__init__(**params)
        self.events = events

    def build_callbacks(self) -> list:
        return [EventLog(self.events, tag="task")]
