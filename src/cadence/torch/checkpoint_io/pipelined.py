"""Pipelined snapshots: the copy of an asynchronous save's tensors runs beside the next step.

The parameters, the optimizer state and the EMA do not change between a save at the loop boundary
and the next ``optimizer.step()``. A pipelined snapshot therefore takes only what the next forward
changes at the boundary (the RNG states, the data position, the buffers, the scheduler's and
scaler's small state) and lists the other tensors as :class:`CopyJobs`; :class:`StateFence` runs
them on a background thread (on CUDA: queued on a side stream, into pinned memory) while training
goes on. Training calls :meth:`StateFence.wait` before anything mutates those tensors (the next
optimizer step, a checkpoint load, the EMA's swap): it waits only for the copy that is left, so a
resume from a pipelined checkpoint is bit-identical to one from a synchronous checkpoint of the
same step. The writer of the checkpoint waits for the same copy (:meth:`PendingCopy.result`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, MutableMapping, MutableSequence

import torch

from cadence.checkpoint.background import Pending, Worker
from cadence.torch.checkpoint_io.staging import clone_tree, copy_tensor

__all__ = ["CopyJobs", "PendingCopy", "StateFence", "defer_tree", "stage_in_background"]

_Slot = tuple[Any, Any]  # (container, key): where a copy goes, a dict or a list and its key / index


class CopyJobs:
    """The tensors a pipelined snapshot copies later: each goes into its slot (a dict's key or a
    list's index, in a container the snapshot owns), copied into the reusable tensor given with it
    when that fits (:func:`~cadence.torch.checkpoint_io.staging.copy_tensor`). A tensor listed
    under several slots (tied weights) is copied once, and every slot gets that one copy."""

    def __init__(self) -> None:
        self._jobs: list[tuple[torch.Tensor, torch.Tensor | None, list[_Slot]]] = []
        self._index: dict[int, int] = {}  # id(source) -> its job
        self._after: list[Callable[[], None]] = []

    def add(self, container: MutableMapping[Any, Any] | MutableSequence[Any], key: Any, source: torch.Tensor,
            reuse: Any = None) -> None:
        """Copy ``source`` (live: not read before :meth:`run`) into ``container[key]`` later; the
        slot holds ``source`` itself until then."""
        container[key] = source
        job = self._index.get(id(source))
        if job is not None:
            self._jobs[job][2].append((container, key))
            return
        self._index[id(source)] = len(self._jobs)
        self._jobs.append((source, reuse if isinstance(reuse, torch.Tensor) else None, [(container, key)]))

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the copies are in their slots (e.g. to relink aliases)."""
        self._after.append(fn)

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def devices(self) -> set[torch.device]:
        """The devices the sources live on."""
        return {source.device for source, _, _ in self._jobs}

    @property
    def nbytes(self) -> int:
        """The bytes the jobs copy."""
        return sum(source.numel() * source.element_size() for source, _, _ in self._jobs)

    def run(self) -> None:
        """Copy every source into its slots (CUDA sources: queued on the current stream, into pinned
        memory, without blocking), then call what :meth:`then` registered."""
        for source, reuse, slots in self._jobs:
            copy = copy_tensor(source, reuse)
            for container, key in slots:
                container[key] = copy
        self._jobs.clear()
        self._index.clear()
        for fn in self._after:
            fn()


def defer_tree(obj: Any, jobs: CopyJobs, reuse: Any = None) -> Any:
    """A copy of the state tree ``obj`` (an optimizer's ``state_dict()``) whose containers are
    rebuilt now and whose tensors are added to ``jobs`` (copied later, into the tensor at the same
    place in ``reuse`` when it fits); a tensor in a tuple is copied now, anything else as
    :func:`~cadence.torch.checkpoint_io.staging.clone_tree` copies it."""
    kind = type(obj)
    if kind in (dict, OrderedDict):
        old = reuse if isinstance(reuse, dict) else {}
        out: dict[Any, Any] = kind()
        for key, value in obj.items():
            if isinstance(value, torch.Tensor):
                jobs.add(out, key, value.detach(), old.get(key))
            else:
                out[key] = defer_tree(value, jobs, old.get(key))
        return out
    if kind is list:
        previous = reuse if isinstance(reuse, list) and len(reuse) == len(obj) else [None] * len(obj)
        items: list[Any] = [None] * len(obj)
        for i, (value, before) in enumerate(zip(obj, previous)):
            if isinstance(value, torch.Tensor):
                jobs.add(items, i, value.detach(), before)
            else:
                items[i] = defer_tree(value, jobs, before)
        return items
    return clone_tree(obj, reuse)


class PendingCopy:
    """A pipelined snapshot's copy in flight. :meth:`result` waits until the copies are in CPU
    memory and readable (the checkpoint's writer); raises the copy's failure."""

    def __init__(self, pending: Pending, done: dict[torch.device, Any] | None = None) -> None:
        self._pending = pending
        self.done = done or {}  # CUDA: per device, an event recorded on its side stream after the copies

    def queued(self) -> None:
        """Wait until every copy is done (CPU) or queued (CUDA); raise the copy's failure."""
        self._pending.result()

    def result(self) -> None:
        """Wait until every copy is in CPU memory; raise the copy's failure."""
        self._pending.result()
        for event in self.done.values():
            event.synchronize()


# Runs the copies of pipelined snapshots, one after the other, at the training thread's CPU priority: the
# next optimizer step waits for them (the writer threads, which nothing waits for, run at a lower one).
_STAGER = Worker("cadence-stage", lower_priority=False)


def stage_in_background(fn: Callable[..., Any], *args: Any) -> Pending:
    """Run ``fn(*args)`` on the thread that copies pipelined snapshots (after the copies queued before)."""
    return _STAGER.submit(fn, *args)


class StateFence:
    """Where training waits for a pipelined snapshot's copy before it mutates the copied tensors.

    :meth:`start` starts a copy on a background thread and returns its :class:`PendingCopy`;
    :meth:`wait` (cheap when nothing is in flight: :attr:`active` is False) waits until it is done:
    on CPU for the copy itself; on CUDA for the copies to be queued on the side stream, and then
    makes the current stream wait for them on the device (the host does not block on the copy).
    A failed copy is not raised here: the checkpoint's writer raises it."""

    def __init__(self) -> None:
        self._copy: PendingCopy | None = None
        self._streams: dict[torch.device, Any] = {}  # CUDA: the side stream of each device

    @property
    def active(self) -> bool:
        """Whether a copy is in flight (or done but not waited for)."""
        return self._copy is not None

    def start(self, jobs: CopyJobs) -> PendingCopy:
        """Copy ``jobs`` in the background (after the copy in flight, if any); the sources must not
        change until :meth:`wait` returns."""
        self.wait()
        cuda = [d for d in jobs.devices if d.type == "cuda"]
        if not cuda:
            copy = PendingCopy(_STAGER.submit(jobs.run))
        else:  # what the current streams have queued up to now (the last optimizer step) is copied
            ready = {d: torch.cuda.current_stream(d).record_event() for d in cuda}
            streams = {d: self._streams.setdefault(d, torch.cuda.Stream(d)) for d in cuda}
            done = {d: torch.cuda.Event() for d in cuda}
            copy = PendingCopy(_STAGER.submit(_run_on_streams, jobs, streams, ready, done), done)
        self._copy = copy
        return copy

    def hold(self, copy: PendingCopy) -> None:
        """Make :meth:`wait` wait for ``copy`` too (a copy started elsewhere: a sharded write's)."""
        self.wait()
        self._copy = copy

    def wait(self) -> None:
        """Return once the tensors of the copy in flight may change (see the class doc)."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        try:
            copy.queued()
        except BaseException:  # noqa: BLE001 - the writer raises it; a failed copy changed nothing
            return
        for device, event in copy.done.items():
            torch.cuda.current_stream(device).wait_event(event)


def _run_on_streams(jobs: CopyJobs, streams: dict[torch.device, Any], ready: dict[torch.device, Any],
                    done: dict[torch.device, Any]) -> None:
    """Queue the copies on each device's side stream, after ``ready``; record ``done`` after them."""
    with contextlib.ExitStack() as stack:
        for device, stream in streams.items():
            stream.wait_event(ready[device])
            stack.enter_context(torch.cuda.stream(stream))
        jobs.run()
    for device, stream in streams.items():
        done[device].record(stream)
