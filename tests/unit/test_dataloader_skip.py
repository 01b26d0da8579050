"""A plain ``DataLoader`` over a map-style dataset resumes mid-epoch without loading the samples
it skips (issue 40, item 8): for torch's samplers, with and without worker processes, in the first
epoch and a later one, the batches after the resume are bit for bit those of an uninterrupted
iteration, random augmentations drawn in the workers included, and the dataset counts no load of
a skipped sample. Anything else is replayed, with
the warning."""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from cadence.torch import Context
from cadence.torch.data import worker_rng
from cadence.torch.data.sampler_skip import SkippingSampler, skippable
from cadence.torch.loop.train_data import TrainData
from cadence.torch.runtime.rng import get_rng_state, set_rng_state
from tasks import TinyTask

N, B, EPOCHS, SEED = 20, 3, 3, 11
LOGGER = "cadence.torch.loop.train_data"


class Counting(Dataset):
    """Sample ``i`` is ``(i, the seed of the process loading it, a random augmentation)``, and each
    load is counted (in shared memory: worker processes count too). The augmentation draws from the
    loading process's global torch, numpy and ``random`` RNGs, as torchvision's transforms and
    numpy-based augmentations do: in a worker, after the worker's earlier samples; the seed proves
    that each worker starts from the uninterrupted run's base seed."""

    def __init__(self) -> None:
        self.loads = torch.zeros(N, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, int, torch.Tensor]:
        self.loads[i] += 1
        info = torch.utils.data.get_worker_info()
        return i, torch.initial_seed() if info is None else info.seed, augmentation()


def augmentation() -> torch.Tensor:
    """A draw from each global RNG of the calling process."""
    return torch.stack([torch.rand(()).double(), torch.tensor(np.random.rand()), torch.tensor(random.random())])


class Samples(list):
    """A collate function of the user's, which keeps the samples as they are (a type of its own)."""


class Batched(Dataset):
    """A dataset that loads a batch at once (``__getitems__``, as Hugging Face datasets do): the
    pads that turn the workers' round are empty batches, ``__getitems__([])``."""

    def __init__(self, base: Counting) -> None:
        self.base = base

    def __len__(self) -> int:
        return N

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self.base[i] for i in indices]


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(N))


class Custom:
    """A sampler cadence does not know: replayed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class MyBatchSampler(BatchSampler):
    """A batch sampler cadence does not know (a subclass): replayed."""


def distributed(ds: Dataset, drop_last: bool) -> DistributedSampler:
    return DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=drop_last)


LOADERS: dict[str, Callable[[Dataset, int], DataLoader]] = {
    "sequential": lambda ds, w: DataLoader(ds, batch_size=B, num_workers=w),
    "shuffle": lambda ds, w: DataLoader(ds, batch_size=B, shuffle=True, num_workers=w),
    "shuffle-generator-drop-last": lambda ds, w: DataLoader(
        ds, batch_size=B, shuffle=True, drop_last=True, num_workers=w, generator=torch.Generator().manual_seed(7)),
    "distributed": lambda ds, w: DataLoader(ds, batch_size=B, sampler=distributed(ds, False), num_workers=w),
    "distributed-drop-last": lambda ds, w: DataLoader(ds, batch_size=B, sampler=distributed(ds, True),
                                                      drop_last=True, num_workers=w),
    "weighted": lambda ds, w: DataLoader(ds, batch_size=B, num_workers=w,
                                         sampler=WeightedRandomSampler(torch.arange(1.0, N + 1), N)),
    "batch-sampler": lambda ds, w: DataLoader(
        ds, batch_sampler=BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(5)), B, True),
        num_workers=w),
    "getitems": lambda ds, w: DataLoader(Batched(ds), batch_size=B, shuffle=True, num_workers=w),
    "unbatched": lambda ds, w: DataLoader(ds, batch_size=None, shuffle=True, num_workers=min(w, 1)),
    "custom-collate": lambda ds, w: DataLoader(ds, batch_size=B, shuffle=True, num_workers=w, collate_fn=Samples),
    "pin-memory": lambda ds, w: DataLoader(ds, batch_size=B, shuffle=True, num_workers=w, pin_memory=True),
}
REPLAYED: dict[str, Callable[[Dataset, int], DataLoader]] = {
    "custom-sampler": lambda ds, w: DataLoader(ds, batch_size=B, sampler=Custom(N), num_workers=w),
    "persistent-workers": lambda ds, w: DataLoader(ds, batch_size=B, shuffle=True, num_workers=2,
                                                   persistent_workers=True),
    "unbatched-2-workers": lambda ds, w: DataLoader(ds, batch_size=None, shuffle=True, num_workers=2),
    "custom-batch-sampler": lambda ds, w: DataLoader(  # its sampler's generator, saved at an epoch's start
        ds, batch_sampler=MyBatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(5)), B, False)),
}
# The batches before the checkpoint, given an epoch's: 3 of the first (2 workers: batch 3 goes to the
# second), 2 of the third.
STOPS: dict[str, Callable[[int], int]] = {"first-epoch": lambda n: 3, "third-epoch": lambda n: 2 * n + 2}


def train_data(loader: DataLoader, epochs: int = EPOCHS) -> TrainData:
    return TrainData(TinyTask(), Context.create(device="cpu"), loader, max_epochs=epochs)


def consume(data: TrainData, limit: int | None = None) -> list[Any]:
    """Draw batches as the trainer does (a torch.rand per batch: the training step's randomness),
    ``limit`` of them or to the data's end; the batches consumed are counted in ``data``."""
    batches: list[Any] = []
    it, consumed = data.iterator(), 0
    while limit is None or len(batches) < limit:
        try:
            batch = next(it)
        except StopIteration:
            started, consumed = data.next_epoch(consumed), 0
            if started is None:
                break
            it, batch = started
        consumed += 1
        batches.append(batch)
        torch.rand(2)
    data.batches_consumed += consumed
    return batches


def resumed_stream(make: Callable[[Dataset, int], DataLoader], workers: int, stop: Callable[[int], int],
                   epochs: int = EPOCHS):
    """The uninterrupted batches past ``stop(batches an epoch)``, those of a resume from a checkpoint
    there (its position through JSON, as state.json holds it), and the resumed run's dataset."""
    torch.manual_seed(SEED)
    loader = make(Counting(), workers)
    stop_at = stop(len(loader))
    straight = train_data(loader, epochs)
    first = consume(straight, stop_at)
    position, rng = json.loads(json.dumps(straight.state())), get_rng_state()
    rest = consume(straight)
    straight.close()
    assert len(first) == stop_at and rest

    torch.manual_seed(SEED)  # a new process seeds as the first one did, then restores
    dataset = Counting()
    resumed = train_data(make(dataset, workers), epochs)
    resumed.restore(position)
    set_rng_state(rng)
    again = consume(resumed)
    resumed.close()
    return rest, again, dataset


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def samples(batches: list[Any]) -> int:
    return sum(len(b) if isinstance(b, Samples) else len(b[0]) if isinstance(b[0], torch.Tensor) and b[0].dim() else 1
               for b in batches)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_resume_skips_without_loading_and_yields_the_uninterrupted_batches(kind, workers, stop, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        rest, again, dataset = resumed_stream(LOADERS[kind], workers, STOPS[stop])
    assert same(again, rest)
    # Every sample loaded by the resumed run is in a batch it yielded: none of the skipped ones.
    assert int(dataset.loads.sum()) == samples(again)
    assert "without loading the skipped samples" in caplog.text and "replaying" not in caplog.text


PERSISTENT_LATER = pytest.mark.xfail(
    strict=True, reason="persistent workers draw their base seed once, in the first epoch: a replay in a later "
                        "epoch creates an iterator that draws it again, before the sampler's seed")


@pytest.mark.parametrize(("kind", "stop"), [
    pytest.param(kind, stop, marks=[PERSISTENT_LATER] if (kind, stop) == ("persistent-workers", "third-epoch") else [])
    for kind in REPLAYED for stop in STOPS])
def test_a_loader_it_cannot_skip_is_replayed_with_the_warning(kind, stop, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        rest, again, dataset = resumed_stream(REPLAYED[kind], 0, STOPS[stop])
    assert same(again, rest)
    assert int(dataset.loads.sum()) > samples(again)  # the replayed batches were loaded
    assert "resuming the train data by replaying" in caplog.text and "without loading" not in caplog.text


def test_what_can_be_skipped():
    ds = Counting()
    assert all(skippable(make(ds, 0)) for make in LOADERS.values())
    assert not any(skippable(make(ds, 0)) for make in REPLAYED.values())
    assert not skippable(DataLoader(Stream(), batch_size=B))
    assert not skippable(DataLoader(ds, batch_size=B, shuffle=True, num_workers=2, in_order=False))
    assert skippable(DataLoader(ds, batch_size=B, shuffle=True, in_order=False))  # no workers: in order anyway
    assert not skippable([[0, 1], [2, 3]])  # a list of batches

    class Loader(DataLoader):
        pass

    assert not skippable(Loader(ds, batch_size=B))
    assert not skippable(DataLoader(ds, sampler=type("Mine", (SequentialSampler,), {})(ds), batch_size=B))


def test_the_skipping_sampler_drops_the_first_items_once():
    sampler = SkippingSampler(BatchSampler(SequentialSampler(range(10)), 3, False), 2)
    assert len(sampler) == 2 and list(sampler) == [[6, 7, 8], [9]] and sampler.skipped == 2
    short = SkippingSampler(range(3), 5)
    assert list(short) == [] and short.skipped == 3 and len(short) == 0
    with pytest.raises(ValueError):
        SkippingSampler(range(3), -1)


def test_the_position_holds_each_worker_s_rng_after_its_last_batch_consumed():
    """Batch k is loaded by worker k % 2: after one batch only worker 0's states are saved (worker
    1 starts fresh on resume), after two both; each is the worker's state after its batch."""
    torch.manual_seed(SEED)
    data = train_data(LOADERS["shuffle"](Counting(), 2))
    consume(data, 1)
    one = data.state()
    consume(data, 1)
    two = data.state()
    data.close()
    assert set(one["workers_rng"]) == {"0"} and set(two["workers_rng"]) == {"0", "1"}
    assert one["workers_rng"]["0"] == two["workers_rng"]["0"] and json.loads(json.dumps(two)) == two
    for kind in ("sequential", "unbatched"):  # no workers: nothing beyond the main process's RNG
        data = train_data(LOADERS[kind](Counting(), 0))
        consume(data, 2)
        assert "workers_rng" not in data.state()


def test_spawned_workers_resume_their_rng_too(caplog):
    """What the workers are given (the collate and init wrappers, their states) is picklable (one
    epoch: each spawned worker imports torch)."""
    spawn = lambda ds, w: DataLoader(ds, batch_size=B, shuffle=True, num_workers=w,  # noqa: E731
                                     multiprocessing_context="spawn")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        rest, again, dataset = resumed_stream(spawn, 2, STOPS["first-epoch"], epochs=1)
    assert same(again, rest) and int(dataset.loads.sum()) == samples(again)
    assert "without loading the skipped samples" in caplog.text

def test_a_worker_rng_state_through_json_restores_all_three_rngs():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # numpy's cached gaussian, kept too
    saved = json.loads(json.dumps(worker_rng.to_json(worker_rng.capture())))
    first = augmentation(), np.random.standard_normal()
    worker_rng.restore(worker_rng.from_json(saved))
    assert same(augmentation(), first[0]) and np.random.standard_normal() == first[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs an accelerator")
def test_a_worker_batch_pins_the_user_s_batch_only():
    rng = worker_rng.capture()
    pinned = worker_rng.WorkerBatch({"x": torch.ones(2)}, 1, rng).pin_memory()
    assert pinned.batch["x"].is_pinned() and pinned.worker == 1 and pinned.rng is rng
