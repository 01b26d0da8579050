"""``torch.profiler`` traces of chosen training steps: :class:`StepProfiler` (the config's
``profiler:`` section, ``cadence train --profile``).

The window is a :class:`~cadence.config.components.profiler.ProfilerConfig`'s, in global steps. Outside its
warmup and recorded steps no profiler exists: its ``on_train_step_end`` compares two integers and
returns. Before a cycle's first warmup step (from the previous step's hook, or from
``on_train_start`` when it is the run's first step) a ``torch.profiler.profile`` is built and
started -- between two steps, so no step is profiled in part; its schedule counts global steps,
so the trace's ``ProfilerStep#N`` markers are the global steps. After the cycle's last recorded
step the profiler is stopped and dropped, and its trace written: one file per rank and cycle,
``MODEL_DIR/profile/rank<R>.<time_ns>.pt.trace.json`` (``.gz`` with ``gzip``), the layout
TensorBoard's profiler plugin reads as run ``profile`` with worker ``rank<R>`` (and Chrome trace
JSON, which Perfetto and chrome://tracing open). Whatever runs between two loops inside a window
(an evaluation, a checkpoint, summaries) is recorded too, inside the next step's marker.

The step that ends a cycle waits for the profiler's processing and the write (not timed by the
hang watchdog). A model dir on an fsspec store gets the trace through a local temp file, removed
after the upload. A trace that cannot be written is a warning, never the run's end.
"""

from __future__ import annotations

import gzip as gzip_module
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from cadence import layout
from cadence.extensions import Callback, RunContext
from cadence.config.components.profiler import NEVER, Cycle, ProfilerConfig
from cadence.storage import Storage
from cadence.runtime.watchdog import Heartbeat, unwatched

if TYPE_CHECKING:  # pragma: no cover
    from cadence.torch.runtime.context import Context

__all__ = ["StepProfiler", "build_step_profiler", "trace_name"]

log = logging.getLogger(__name__)

TRACE_SUFFIX = ".pt.trace.json"


def trace_name(rank: int, *, gzip: bool = False, time_ns: int | None = None) -> str:
    """``rank<R>.<time_ns>.pt.trace.json[.gz]``: worker ``rank<R>`` and a span for TensorBoard's
    profiler plugin (the form of ``torch.profiler.tensorboard_trace_handler``)."""
    stamp = time.time_ns() if time_ns is None else time_ns
    return f"rank{rank}.{stamp}{TRACE_SUFFIX}" + (".gz" if gzip else "")


class StepProfiler(Callback):
    """Traces the steps of ``settings``' window on this rank into ``directory`` (a local path or an
    fsspec URL), with its options (``record_shapes``, ``profile_memory``, ``with_stack``, ``gzip``).

    A :class:`~cadence.Callback`, registered once in the controller's callbacks:
    ``on_train_step_end`` drives the profiler, ``on_train_start`` starts a cycle that begins at
    the run's first step, ``on_close`` stops a profiler that training left running and writes
    what it recorded.
    ``device``: CUDA kernels are traced too when it is a CUDA device. ``last_step``: the run's
    last step (``trainer.train_steps``; None: unknown), where a cycle is cut short and written
    (a cycle recording nothing before it is not started). A run that ends otherwise inside a
    cycle (preempted, stopped, out of data) gets the trace of the steps recorded when it closes;
    its last ``ProfilerStep#N`` marker is then the step that did not run (the end of the run).
    :attr:`traces` lists the paths written, in order.
    """

    def __init__(self, settings: ProfilerConfig, directory: str, *, rank: int = 0,
                 device: torch.device | str = "cpu", heartbeat: Heartbeat | None = None,
                 last_step: int | None = None) -> None:
        self.window = settings
        self.last_step = NEVER if last_step is None else last_step
        self.directory = directory
        self.rank = rank
        self.device = torch.device(device)
        self.record_shapes, self.profile_memory = settings.record_shapes, settings.profile_memory
        self.with_stack, self.gzip = settings.with_stack, settings.gzip
        self.heartbeat = heartbeat
        self.traces: list[str] = []
        self._arm = settings.next_start(1) - 1  # on_train_step_end(step) does nothing while step < _arm
        self._prof: torch.profiler.profile | None = None
        self._cycle: Cycle | None = None
        self._expected = 0  # the global step the running profiler is in
        self._planned: Cycle | None = None  # the running cycle as the window has it (before a cut)

    # -- hooks ---------------------------------------------------------------------------------

    def on_train_start(self, run: RunContext) -> None:
        if self._prof is None:
            self._arm_for(run.global_step + 1)

    def on_train_step_end(self, run: RunContext, step: int) -> None:
        """Outside a window: one comparison. Before a cycle: start it; inside: the profiler's
        step; after its last recorded step: stop it and write the trace."""
        if self._prof is None:
            if step < self._arm:
                return
            self._arm_for(step + 1)
            return
        if step != self._expected:  # the step went back (a NaN rollback): keep what was recorded
            log.warning("profiler: the global step went from %d to %d inside the window: the trace ends here",
                        self._expected, step)
            self._finish(self._expected - 1)
            self._arm_for(step + 1)
            return
        assert self._cycle is not None
        if step >= self._cycle.last_active:
            self._finish(step)
            return
        self._expected = step + 1
        self._prof.step()

    def on_close(self, run: RunContext) -> None:
        if self._prof is not None:  # training ended inside a window
            self._finish(self._expected - 1)

    # -- the profiler --------------------------------------------------------------------------

    def _arm_for(self, step: int) -> None:
        """``step`` runs next: start its cycle when one starts there, else wait for the next."""
        start = self.window.next_start(step)
        if start == step:
            cycle = self.window.starting_at(step)
            assert cycle is not None
            if cycle.first_active <= self.last_step:
                self._start(replace(cycle, last_active=min(cycle.last_active, self.last_step)), step)
            else:  # the run ends before this cycle records
                self._arm = NEVER
            return
        skipped = self.window.cycle_of(step)
        if skipped is not None:
            log.info("profiler: step %d runs inside the recorded steps %s: that cycle is not traced", step,
                     skipped.active_steps)
        self._arm = start - 1 if start != NEVER else NEVER

    def _start(self, cycle: Cycle, step: int) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, schedule=_schedule(cycle, step),
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack)
        prof.step_num = step  # the schedule and the ProfilerStep#N markers count global steps
        prof.start()
        self._prof, self._cycle, self._expected = prof, cycle, step
        self._planned = self.window.cycle(cycle.index)

    def _finish(self, last: int) -> None:
        """Stop the profiler after step ``last`` and write its trace when it recorded a step."""
        prof, cycle = self._prof, self._cycle
        assert prof is not None and cycle is not None
        self._prof = self._cycle = None
        with unwatched(self.heartbeat):  # the profiler's processing and the write are no hang
            recorded = last >= cycle.first_active
            if recorded:
                prof.add_metadata_json("cadence", json.dumps(
                    {"rank": self.rank, "cycle": cycle.index, "steps": [cycle.first_active, last]}))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the last step's kernels are in the trace
            prof.stop()
            if recorded:
                self._write(prof, cycle, last)
            else:
                log.info("profiler: rank %d stopped in the warmup of steps %s: nothing recorded", self.rank,
                         cycle.active_steps)
        after = self.window.next_start(last + 1)
        self._arm = after - 1 if after != NEVER else NEVER

    def _write(self, prof: torch.profiler.profile, cycle: Cycle, last: int) -> None:
        storage = Storage(self.directory)
        name = trace_name(self.rank, gzip=self.gzip)
        path = storage.join(name)
        steps = replace(cycle, last_active=last).active_steps
        if self._planned is not None and last != self._planned.last_active:
            steps += f" (of {self._planned.active_steps})"
        temp = tempfile.mkdtemp(prefix="cadence-trace-")
        local = os.path.join(temp, name.removesuffix(".gz"))  # its name is the trace's traceName
        try:
            prof.export_chrome_trace(local)
            storage.makedirs(storage.root)
            with open(local, "rb") as source, storage.open_atomic(path) as target:
                if self.gzip:
                    with gzip_module.GzipFile(fileobj=target, mode="wb", mtime=0) as packed:
                        shutil.copyfileobj(source, packed, 1 << 20)
                else:
                    shutil.copyfileobj(source, target, 1 << 20)
        except Exception as e:  # a diagnostic: training goes on
            log.warning("profiler: rank %d could not write the trace of steps %s to %s: %s", self.rank, steps,
                        storage.url(path), e)
            return
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        self.traces.append(storage.url(path))
        log.info("profiler: rank %d traced steps %s: %s", self.rank, steps, storage.url(path))


def _schedule(cycle: Cycle, first: int) -> Callable[[int], ProfilerAction]:
    """The profiler's schedule for ``cycle`` started before global step ``first``: warmup up to
    its first recorded step, record to its last (and save), nothing after. The profiler asks for
    step 0 when it is built: steps before ``first`` read as ``first``."""

    def action(step: int) -> ProfilerAction:
        step = max(step, first)
        if step < cycle.first_active:
            return ProfilerAction.WARMUP
        if step < cycle.last_active:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == cycle.last_active else ProfilerAction.NONE

    return action


def build_step_profiler(config: ProfilerConfig, model_dir: str, ctx: Context, *,
                        train_steps: int | None = None) -> StepProfiler:
    """The run's :class:`StepProfiler` from the ``profiler:`` section, writing into
    ``MODEL_DIR/profile/``; the chief logs which steps it traces, and warns when the first cycle
    records nothing up to ``train_steps`` (a cycle that ends after it is cut there)."""
    directory = layout.profile_dir(model_dir)
    if ctx.is_chief:
        first = config.cycle(0)
        assert first is not None
        if train_steps is not None and first.first_active > train_steps:
            log.warning("profiler: the first cycle records steps %s, after trainer.train_steps (%d): nothing will be "
                        "traced (lower profiler.skip_first or profiler.wait)", first.active_steps, train_steps)
        else:
            log.info("profiler: tracing %s into %s (one trace per rank and cycle)", config.describe(), directory)
    return StepProfiler(config, directory, rank=ctx.rank, device=ctx.device, heartbeat=ctx.heartbeat,
                        last_step=train_steps)
