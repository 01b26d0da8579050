"""The "Replica groups" part of ``cadence report`` for a run of fault-tolerant replica groups
(``trainer.fault_tolerance``): read from every group's ``metrics.jsonl`` (group 0's in
``MODEL_DIR/train/``, group r's in ``MODEL_DIR/replicas/group<r>/train/``), whose rows (one per
logged loop) hold ``replicas`` (the fewest groups that took part in a step of the loop),
``replica_short_steps`` (its steps with fewer than R groups), ``replica_retries`` (its steps run
again), ``replica_samples_skipped`` and ``replica_samples_repeated``.

:func:`read_replica_groups` sums them per group and in total; the steps run with fewer groups are
given as ranges of loops (a loop of ``steps_per_loop`` steps whose fewest was below R counts whole:
log every step for per-step ranges), and counted exactly per group. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadence import layout
from cadence.reports.page import escape as _e
from cadence.reports.page import html_table as _table
from cadence.summaries.metrics_file import read_metrics

__all__ = ["GroupCounts", "ReplicaGroups", "read_replica_groups", "replica_groups_of", "replica_section",
           "step_ranges"]

REPLICAS, RETRIES, SHORT = "replicas", "replica_retries", "replica_short_steps"
SKIPPED, REPEATED = "replica_samples_skipped", "replica_samples_repeated"


@dataclass
class GroupCounts:
    """One group's sums over its ``metrics.jsonl``."""

    group: int
    loops: int = 0  # rows with ``replicas``
    short: list[tuple[int, int]] = field(default_factory=list)  # step ranges run with fewer than R groups
    short_steps: int = 0  # this group's steps with fewer than R groups, counted per step
    retried: list[tuple[int, int]] = field(default_factory=list)  # the loops with steps run again
    retries: int = 0
    skipped: int = 0
    repeated: int = 0


@dataclass
class ReplicaGroups:
    """Every group's :class:`GroupCounts` and the run's totals; ``short``: the union of the groups'
    ranges with fewer than ``groups`` groups."""

    groups: int
    counts: list[GroupCounts]
    short: list[tuple[int, int]]

    @property
    def retries(self) -> int:
        return sum(c.retries for c in self.counts)

    @property
    def skipped(self) -> int:
        return sum(c.skipped for c in self.counts)

    @property
    def repeated(self) -> int:
        return sum(c.repeated for c in self.counts)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else 0


def step_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (first, last step; inclusive) merged where they touch or overlap, in order."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _group_counts(group: int, records: Sequence[Mapping[str, Any]], groups: int) -> GroupCounts:
    counts = GroupCounts(group)
    short: list[tuple[int, int]] = []
    retried: list[tuple[int, int]] = []
    previous: int | None = None
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or REPLICAS not in record:
            continue
        first = previous + 1 if previous is not None and previous < step else step  # the loop's steps
        previous = step
        counts.loops += 1
        if _count(record.get(REPLICAS)) < groups:
            short.append((first, step))
        retries = _count(record.get(RETRIES))
        if retries:
            retried.append((first, step))
        counts.retries += retries
        counts.short_steps += _count(record.get(SHORT))
        counts.skipped += _count(record.get(SKIPPED))
        counts.repeated += _count(record.get(REPEATED))
    counts.short, counts.retried = step_ranges(short), step_ranges(retried)
    return counts


def read_replica_groups(model_dir: str, groups: int | None) -> ReplicaGroups | None:
    """The counts of a run of replica groups in ``model_dir``; ``groups``: R from its config
    (``trainer.fault_tolerance.replica_groups``; None: the config has none, then nothing unless group
    0's rows hold ``replicas``, and R is the most groups a row saw). None when the run had none."""
    first = read_metrics(layout.train_dir(model_dir))
    if groups is None:
        seen = [_count(r.get(REPLICAS)) for r in first if REPLICAS in r]
        if not seen:
            return None
        groups = max(seen)
    counts = [_group_counts(0, first, groups)]
    for group in range(1, groups):
        counts.append(_group_counts(group, read_metrics(layout.train_dir(layout.replica_group_dir(model_dir, group))), groups))
    return ReplicaGroups(groups, counts, step_ranges([span for c in counts for span in c.short]))


def replica_groups_of(config_text: str | None) -> int | None:
    """``trainer.fault_tolerance.replica_groups`` of a config's YAML text (None when it has none)."""
    import yaml

    try:
        document = yaml.safe_load(config_text) if config_text is not None else None
    except yaml.YAMLError:
        return None
    trainer = document.get("trainer") if isinstance(document, Mapping) else None
    ft = trainer.get("fault_tolerance") if isinstance(trainer, Mapping) else None
    groups = ft.get("replica_groups") if isinstance(ft, Mapping) else None
    return groups if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1 else None


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "none"


def replica_section(summary: ReplicaGroups) -> str:
    """The report's "Replica groups" part (HTML)."""
    r = summary.groups
    total = (f"{r} groups; steps with fewer than {r} groups: {_ranges(summary.short)}; steps run again: "
             f"{summary.retries}; samples skipped: {summary.skipped}; samples seen twice: {summary.repeated}")
    rows = [[c.group, c.loops, f"{c.short_steps} ({_ranges(c.short)})",
             f"{c.retries} ({_ranges(c.retried)})" if c.retries else 0, c.skipped, c.repeated] for c in summary.counts]
    rows.append(["all", sum(c.loops for c in summary.counts), _ranges(summary.short), summary.retries,
                 summary.skipped, summary.repeated])
    notes = ("Steps with fewer groups: per group, its steps that took part with fewer than R groups "
             "(<code>replica_short_steps</code>), then the logged loops whose <code>replicas</code> (the fewest "
             "groups in a step of the loop) was below R, as step ranges (a loop counts whole). Steps run again: dropped "
             "when a group was lost mid-step (in the loops shown). Samples skipped: drawn in steps that were "
             "dropped. Samples seen twice: of committed steps, already reached in a committed step before a "
             "restore or heal put the group behind.")
    return "\n".join([
        "<h2>Replica groups</h2>",
        f"<p>{_e(total)}</p>",
        _table(["group", "loops logged", f"steps with fewer than {r} groups", "steps run again",
                "samples skipped", "samples seen twice"], rows),
        f'<p class="sub">{notes}</p>',
    ])
