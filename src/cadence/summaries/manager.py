"""``SummaryManager``: a run's summaries written as Orbit's are, one directory per nested output."""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Mapping
from typing import Any

from cadence.summaries.metrics_file import METRICS_FILE, RESERVED, join, read_metrics, truncate_metrics
from cadence.summaries.writer import SummaryWriter

__all__ = ["SummaryManager"]

logger = logging.getLogger("cadence")


class SummaryManager:
    """The summaries of one directory, written as Orbit's ``SummaryManager`` writes them.

    :meth:`write_summaries` takes a run's output, e.g. an evaluation over two datasets
    ``{"loss": 0.3, "ds1": {"accuracy": 0.9}, "ds2": {"accuracy": 0.8}}``: the flat entries go to
    TensorBoard events in ``summary_dir``, and each top-level key whose value is a mapping gets a
    subdirectory (``summary_dir/ds1/``) whose events hold its entries as tags (``accuracy``; deeper
    mappings as ``a/b`` tags), so TensorBoard draws the datasets as curves of one chart.
    ``summary_dir/metrics.jsonl`` records the whole output, nested keys as ``ds1/accuracy``.

    Args:
      summary_dir: a local path or fsspec URL (remote: ``metrics.jsonl`` only, see
        :class:`SummaryWriter`); ``None``: nothing is written.
      enabled: False writes nothing (e.g. on all but the chief of several ranks).

    Writers and directories are created on the first write that needs them; :meth:`close`
    closes them (a later write opens them again).
    """

    def __init__(self, summary_dir: str | os.PathLike[str] | None, *, enabled: bool = True) -> None:
        self.summary_dir = None if summary_dir is None else os.fspath(summary_dir)
        self.enabled = enabled and summary_dir is not None
        self._writers: dict[str, SummaryWriter] = {}
        self._purge_step: int | None = None  # set by resume_at()
        self._purged: set[str] = set()  # the relative paths whose writer was given the purge step

    def resume_at(self, step: int) -> None:
        """The run goes on from ``step`` (its restored checkpoint): drop what a killed run wrote past it.

        Now: the records of ``summary_dir/metrics.jsonl`` with a larger step (the file is replaced
        at once, see :func:`truncate_metrics`). Then: the first writer of each directory marks the
        restart in its new event file (``purge_step=step + 1``, see :class:`SummaryWriter`), so
        TensorBoard discards the old events past ``step`` too. Call it once, before the first write
        of the resumed run; later writers (after :meth:`close`) do not mark it again. No-op when
        disabled (e.g. on all but the chief).
        """
        if not self.enabled or self.summary_dir is None:
            return
        self.close()
        self._purge_step = operator.index(step) + 1
        self._purged.clear()
        dropped = truncate_metrics(self.summary_dir, step)
        if dropped:
            logger.info("%s: dropped %d record(s) past step %d, written before the restart",
                        join(self.summary_dir, METRICS_FILE), dropped, step)

    def summary_writer(self, relative_path: str = "") -> SummaryWriter:
        """The writer of ``summary_dir/relative_path`` (``""``: the directory itself), created on
        first use. Raises ValueError for ``SummaryManager(None)``."""
        if self.summary_dir is None:
            raise ValueError("SummaryManager(None) has no directory to write to")
        if relative_path not in self._writers:
            logdir = join(self.summary_dir, relative_path) if relative_path else self.summary_dir
            purge_step = None if relative_path in self._purged else self._purge_step
            self._purged.add(relative_path)
            self._writers[relative_path] = SummaryWriter(logdir, purge_step=purge_step)
        return self._writers[relative_path]

    def write_summaries(self, step: int, summary_dict: Mapping[str, Any]) -> None:
        """Write ``summary_dict`` at ``step``: see the class docstring. No-op when disabled."""
        if not self.enabled:
            return
        flat = {k: v for k, v in summary_dict.items() if not isinstance(v, Mapping)}
        root = self.summary_writer()
        root.write(step, summary_dict, events=False)
        root.write(step, flat, jsonl=False)
        for key, value in summary_dict.items():
            if isinstance(value, Mapping):
                self.summary_writer(str(key)).write(step, value, jsonl=False)

    def recorded(self, step: int) -> dict[str, Any]:
        """The metrics last recorded at ``step`` in ``summary_dir/metrics.jsonl`` (nested keys
        flattened, as written there; without ``step`` and ``time``); ``{}`` when none is."""
        if self.summary_dir is None:
            return {}
        records = [r for r in read_metrics(self.summary_dir) if r.get("step") == step]
        return {k: v for k, v in records[-1].items() if k not in RESERVED} if records else {}

    def flush(self) -> None:
        """Push what every writer of this manager has written to disk (or the remote store)."""
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer. Idempotent; a later write opens new ones."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def __repr__(self) -> str:
        return f"SummaryManager({self.summary_dir!r}, enabled={self.enabled})"
