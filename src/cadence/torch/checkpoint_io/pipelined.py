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
import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, MutableMapping, MutableSequence, NamedTuple, Sequence

import torch

from cadence.checkpoint.background import Pending, Worker
from cadence.torch.checkpoint_io.staging import clone_tree, copy_tensor, copy_tensors

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
        self._batches: list[_Batch] = []
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

    def add_batch(self, sources: Sequence[torch.Tensor], into: Callable[[], Sequence[Any]],
                  place: Callable[[list[torch.Tensor]], None], devices: set[torch.device], *,
                  fitted: Sequence[torch.Tensor] | None = None) -> None:
        """Copy the distinct plain tensors ``sources`` (live) later, all in one call
        (:func:`~cadence.torch.checkpoint_io.staging.copy_tensors`), each into the tensor at its
        index in ``into()`` when that fits, or into ``fitted``'s (known to fit: a previous copy of
        the same tensors, no longer needed); then call ``place(copies)`` to put them into their
        slots. What :meth:`add` does per tensor, with the slots' bookkeeping done once by the
        caller (a layout kept from save to save, :mod:`~cadence.torch.checkpoint_io.snapshot_layouts`).
        ``devices``: the sources'. The sources are not deduplicated against the other jobs'."""
        self._batches.append(_Batch(sources, into, place, devices, fitted))

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the copies are in their slots (e.g. to relink aliases)."""
        self._after.append(fn)

    def __len__(self) -> int:
        return len(self._jobs) + sum(len(batch.sources) for batch in self._batches)

    @property
    def devices(self) -> set[torch.device]:
        """The devices the sources live on."""
        return {source.device for source, _, _ in self._jobs}.union(*(batch.devices for batch in self._batches))

    @property
    def nbytes(self) -> int:
        """The bytes the jobs copy."""
        sources = [source for source, _, _ in self._jobs] + [t for batch in self._batches for t in batch.sources]
        return sum(source.numel() * source.element_size() for source in sources)

    def run(self) -> None:
        """Copy every source into its slots (CUDA sources: queued on the current stream, into pinned
        memory, without blocking), then call what :meth:`then` registered."""
        for source, reuse, slots in self._jobs:
            copy = copy_tensor(source, reuse)
            for container, key in slots:
                container[key] = copy
        self._jobs.clear()
        self._index.clear()
        for batch in self._batches:
            cuda = any(device.type == "cuda" for device in batch.devices)
            if batch.fitted is not None:
                batch.place(copy_tensors(batch.sources, batch.fitted, cuda=cuda, fitted=True))
            else:
                batch.place(copy_tensors(batch.sources, batch.into(), cuda=cuda))
        self._batches.clear()
        for fn in self._after:
            fn()


class _Batch(NamedTuple):
    sources: Sequence[torch.Tensor]
    into: Callable[[], Sequence[Any]]
    place: Callable[[list[torch.Tensor]], None]
    devices: set[torch.device]
    fitted: Sequence[torch.Tensor] | None


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
    """A pipelined snapshot's copy. :meth:`result` waits until the copies are in CPU memory and
    readable (the checkpoint's writer); raises the copy's failure.

    ``pending``: the copy in flight, or what starts it (returns it): the copy then starts at the
    first of :meth:`start` (training resumes after the save, :meth:`StateFence.resume`),
    :meth:`queued` and :meth:`result`, on whichever thread calls it first."""

    def __init__(self, pending: Pending | Callable[[], Pending], done: dict[torch.device, Any] | None = None) -> None:
        self._pending = pending if isinstance(pending, Pending) else None
        self._submit = None if isinstance(pending, Pending) else pending
        self._lock = threading.Lock()
        self.done = done or {}  # CUDA: per device, an event recorded on its side stream after the copies

    def start(self) -> Pending:
        """Start the copy, if not started yet; return it."""
        with self._lock:
            if self._pending is None:
                assert self._submit is not None
                self._pending, self._submit = self._submit(), None
            return self._pending

    def queued(self) -> None:
        """Wait until every copy is done (CPU) or queued (CUDA); raise the copy's failure."""
        self.start().result()

    def result(self) -> None:
        """Wait until every copy is in CPU memory; raise the copy's failure."""
        self.start().result()
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

    :meth:`start` hands a copy to a background thread and returns its :class:`PendingCopy`; the
    copy starts once training resumes (:meth:`resume`, the trainer's next :meth:`train` call), or
    as soon as the checkpoint's writer or :meth:`wait` needs it: the rest of the save call (its
    writer thread's start) does not compete with the copy for the CPU and the GIL. :meth:`wait`
    (cheap when nothing is in flight: :attr:`active` is False) waits until the copy is done: on
    CPU for the copy itself; on CUDA for the copies to be queued on the side stream, and then makes
    the current stream wait for them on the device (the host does not block on the copy). A failed
    copy is not raised here: the checkpoint's writer raises it."""

    def __init__(self) -> None:
        self._copy: PendingCopy | None = None
        self._streams: dict[torch.device, Any] = {}  # CUDA: the side stream of each device

    @property
    def active(self) -> bool:
        """Whether a copy is in flight (or done but not waited for)."""
        return self._copy is not None

    def resume(self) -> bool:
        """Training resumes after a save: start its copy (if it has not started); return :attr:`active`."""
        copy = self._copy
        if copy is None:
            return False
        copy.start()
        return True

    def start(self, jobs: CopyJobs) -> PendingCopy:
        """Copy ``jobs`` in the background (after the copy in flight, if any), from :meth:`resume`
        on; the sources must not change until :meth:`wait` returns."""
        self.wait()
        _STAGER.start()  # from the training thread: the copy runs at its priority, whoever submits it later
        cuda = [d for d in jobs.devices if d.type == "cuda"]
        if not cuda:
            copy = PendingCopy(functools.partial(_STAGER.submit, jobs.run))
        else:  # what the current streams have queued up to now (the last optimizer step) is copied
            ready = {d: torch.cuda.current_stream(d).record_event() for d in cuda}
            streams = {d: self._streams.setdefault(d, torch.cuda.Stream(d)) for d in cuda}
            done = {d: torch.cuda.Event() for d in cuda}
            copy = PendingCopy(functools.partial(_STAGER.submit, _run_on_streams, jobs, streams, ready, done), done)
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
