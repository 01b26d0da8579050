"""The global RNGs of a ``DataLoader``'s worker processes, carried across a skip: what makes a
resume that skips the consumed batches (:mod:`cadence.torch.data.sampler_skip`) bit-identical
when the dataset draws random augmentations in its workers.

Each batch is collated in a worker by :class:`RngCollate`, which returns it as a
:class:`WorkerBatch`: the user's batch, the worker's id and the worker's torch CPU, ``numpy.random``
and ``random`` states right after the batch was loaded and collated (11 KB pickled, about 0.15 ms
a batch). In the main process :class:`RngTracker` yields the user's batch and keeps, per worker, the states after
its last batch consumed (:meth:`RngTracker.states`), which the checkpoint saves (JSON:
:func:`to_json`). On resume the workers start as in the uninterrupted run (the same base seed, the
user's ``worker_init_fn``), then :class:`RestoreRng` sets each worker that had delivered a
consumed batch in the epoch to its saved states; a worker that had not needs nothing, its fresh
seeding being the uninterrupted one. With ``num_workers=0`` nothing of this runs: samples are
drawn from the main process's RNG, which the checkpoint restores.
"""

from __future__ import annotations

import base64
import random
from collections import deque
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory

__all__ = ["RestoreRng", "RngCollate", "RngTracker", "WorkerBatch", "WorkerRng", "capture", "from_json",
           "restore", "to_json"]

WorkerRng = dict[str, Any]
"""A process's global RNG states: ``{"torch": bytes, "numpy": numpy's state tuple, "random": random's}``."""

_KEPT = 4  # states kept per worker: the batches a caller may draw past the position it saves


def capture() -> WorkerRng:
    """This process's torch CPU, ``numpy.random`` and ``random`` states (picklable, no tensor)."""
    return {"torch": torch.get_rng_state().numpy().tobytes(), "numpy": np.random.get_state(),
            "random": random.getstate()}


def restore(state: WorkerRng) -> None:
    """Set this process's three global RNGs to ``state`` (from :func:`capture`)."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])


def to_json(state: WorkerRng) -> dict[str, Any]:
    """``state`` as JSON: the torch state's bytes in base64, numpy's and random's as lists."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["random"]
    return {"torch": base64.b64encode(state["torch"]).decode("ascii"),
            "numpy": [str(name), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
            "random": [int(version), list(internal), gauss]}


def from_json(obj: Mapping[str, Any]) -> WorkerRng:
    """The state :func:`to_json` encoded as ``obj``."""
    name, keys, pos, has_gauss, cached = obj["numpy"]
    version, internal, gauss = obj["random"]
    return {"torch": base64.b64decode(obj["torch"]),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            "random": (version, tuple(internal), gauss)}


class WorkerBatch:
    """A batch collated in worker ``worker``, and that worker's RNG states right after (:func:`capture`).
    Pinned, it pins ``batch`` only (``pin_memory=True``)."""

    __slots__ = ("batch", "rng", "worker")

    def __init__(self, batch: Any, worker: int, rng: WorkerRng) -> None:
        self.batch = batch
        self.worker = worker
        self.rng = rng

    def __reduce__(self) -> tuple[Any, ...]:
        return WorkerBatch, (self.batch, self.worker, self.rng)

    def pin_memory(self) -> WorkerBatch:
        return WorkerBatch(pin_memory(self.batch), self.worker, self.rng)


class RngCollate:
    """``collate_fn``, whose result in a worker process is a :class:`WorkerBatch` (in the main
    process: unchanged). Picklable when ``collate_fn`` is (``spawn`` workers)."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        collated = self.collate_fn(batch)
        info = get_worker_info()
        return collated if info is None else WorkerBatch(collated, info.id, capture())


class RestoreRng:
    """A ``worker_init_fn``: the user's ``init_fn`` (if any), then the worker's RNGs set to
    ``states[worker_id]`` when there is one."""

    def __init__(self, init_fn: Callable[[int], None] | None, states: Mapping[int, WorkerRng]) -> None:
        self.init_fn = init_fn
        self.states = dict(states)

    def __call__(self, worker_id: int) -> None:
        if self.init_fn is not None:
            self.init_fn(worker_id)
        state = self.states.get(worker_id)
        if state is not None:
            restore(state)


class RngTracker:
    """Iterates ``iterator`` (a ``DataLoader``'s, collating with :class:`RngCollate`): yields the
    user's batches and keeps each worker's RNG states after its recent batches. Its first batch is
    batch ``start`` of the epoch; ``restored``: the workers' states at batch ``start`` (a resume's)."""

    def __init__(self, iterator: Iterator[Any], start: int = 0, restored: Mapping[int, WorkerRng] | None = None) -> None:
        self._iterator = iterator
        self.yielded = start  # batches of the epoch yielded
        self._restored = dict(restored or {})
        self._recent: dict[int, deque[tuple[int, WorkerRng]]] = {}

    def __iter__(self) -> RngTracker:
        return self

    def __next__(self) -> Any:
        item = next(self._iterator)
        self.yielded += 1
        if not isinstance(item, WorkerBatch):
            return item
        self._recent.setdefault(item.worker, deque(maxlen=_KEPT)).append((self.yielded - 1, item.rng))
        return item.batch

    def states(self, consumed: int) -> dict[int, WorkerRng]:
        """Each worker's RNG states after the last of its batches before batch ``consumed`` of the
        epoch (or as restored); a worker with none is absent (it starts fresh)."""
        found = dict(self._restored)
        for worker, recent in self._recent.items():
            before = [state for index, state in recent if index < consumed]
            if before:
                found[worker] = before[-1]
            elif len(recent) == recent.maxlen:
                raise RuntimeError(f"the train data was iterated {self.yielded - consumed} batches past the position "
                                   f"saved (batch {consumed}): worker {worker}'s RNG state there is no longer known")
        return found

    def _shutdown_workers(self) -> None:
        """End the workers of the iterator (``TrainData.close``)."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
