"""ResumableSampler / ResumableLoader: order, determinism, sharding, exact O(1) resume."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import Dataset

from cadence.torch import ResumableLoader, ResumableSampler


class Indexed(Dataset):
    """Returns its index; records every index it was asked for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched.append(int(i))
        return torch.tensor(i)


def flat(batches) -> list[int]:
    return [int(x) for b in batches for x in b]


# -- sampler -----------------------------------------------------------------------------------


def test_sampler_is_deterministic_permutation_per_epoch():
    s = ResumableSampler(100, seed=7)
    e0 = list(s)
    assert sorted(e0) == list(range(100)) and e0 != list(range(100))
    assert list(ResumableSampler(100, seed=7)) == e0
    assert list(ResumableSampler(100, seed=8)) != e0
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e1) == list(range(100)) and e1 != e0
    g = torch.Generator().manual_seed(7 + 1)
    assert e1 == torch.randperm(100, generator=g).tolist()
    assert list(ResumableSampler(10, shuffle=False)) == list(range(10))


def test_sampler_offset_slices():
    s = ResumableSampler(50, seed=3)
    full = list(s)
    s.set_offset(17)
    assert list(s) == full[17:] and len(s) == 33
    s.set_offset(50)
    assert list(s) == [] and len(s) == 0


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [1001, 999, 12])
def test_sampler_shards_are_disjoint_cover_without_padding(world_size, n):
    shards = [list(ResumableSampler(n, seed=1, rank=r, world_size=world_size)) for r in range(world_size)]
    everything = [i for s in shards for i in s]
    assert len(everything) == n and sorted(everything) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for r, s in enumerate(shards):
        assert len(ResumableSampler(n, seed=1, rank=r, world_size=world_size)) == len(s)
    # strided over the global order
    perm = ResumableSampler(n, seed=1).permutation().tolist()
    assert shards[1] == perm[1::world_size]


def test_sampler_drop_last_equalises_ranks():
    shards = [list(ResumableSampler(1001, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert [len(s) for s in shards] == [333, 333, 333]
    assert len(set(itertools.chain(*shards))) == 999


# -- loader ------------------------------------------------------------------------------------


def test_loader_epochs_and_len():
    ds = Indexed(23)
    loader = ResumableLoader(ds, 5, seed=0, epochs=2)
    assert len(loader) == 5
    batches = list(loader)
    assert len(batches) == 10 and [len(b) for b in batches[:5]] == [5, 5, 5, 5, 3]
    e0, e1 = flat(batches[:5]), flat(batches[5:])
    assert sorted(e0) == sorted(e1) == list(range(23)) and e0 != e1
    assert loader.state_dict() == {"epoch": 2, "offset": 0}
    assert len(ResumableLoader(ds, 5, drop_last=True)) == 4
    assert len(list(ResumableLoader(ds, 5, drop_last=True, epochs=1))) == 4


def test_loader_forever_and_reiteration_starts_over():
    loader = ResumableLoader(Indexed(10), 4, seed=1)
    first = list(itertools.islice(loader, 7))  # crosses two epoch boundaries
    assert len(first) == 7
    again = list(itertools.islice(loader, 7))
    assert [b.tolist() for b in first] == [b.tolist() for b in again]


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 5, 6, 9])
def test_loader_resume_matches_uninterrupted(stop):
    # 4 batches per epoch (last one short), epochs=2 ending: 8 batches in all
    reference = [b.tolist() for b in ResumableLoader(Indexed(14), 4, seed=5, epochs=2)]
    assert len(reference) == 8
    loader = ResumableLoader(Indexed(14), 4, seed=5, epochs=2)
    head = [b.tolist() for b in itertools.islice(loader, stop)]
    state = loader.state_dict()
    ds = Indexed(14)
    resumed = ResumableLoader(ds, 4, seed=5, epochs=2)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in resumed]
    assert head + tail == reference
    assert resumed.state_dict() == {"epoch": 2, "offset": 0}
    # skipped samples are never loaded: exactly the remaining ones are fetched
    assert sorted(ds.fetched) == sorted(i for b in reference[len(head):] for i in b)


def test_loader_resume_forever_across_epoch_boundary_and_reload():
    reference = [b.tolist() for b in itertools.islice(ResumableLoader(Indexed(10), 3, seed=2), 12)]
    loader = ResumableLoader(Indexed(10), 3, seed=2)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(4)]  # exactly one epoch: state moves to the next
    state = loader.state_dict()
    assert state == {"epoch": 1, "offset": 0}
    [next(it) for _ in range(2)]
    loader.load_state_dict(state)  # the old iterator ends; the next iter() resumes at `state`
    assert list(it) == []
    tail = [b.tolist() for b in itertools.islice(loader, 8)]
    assert head + tail == reference


def test_loader_resume_does_not_replay_large_offset():
    ds = Indexed(100_000)
    loader = ResumableLoader(ds, 10, seed=0, epochs=1)
    loader.load_state_dict({"epoch": 0, "offset": 99_980})
    batches = list(loader)
    assert len(batches) == 2 and len(ds.fetched) == 20
    perm = ResumableSampler(100_000, seed=0).permutation().tolist()
    assert flat(batches) == perm[99_980:]


@pytest.mark.parametrize("world_size", [2, 3])
def test_loader_shards_and_global_offset(world_size):
    n, b = 1001, 7
    loaders = [ResumableLoader(Indexed(n), b, seed=9, epochs=1, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [list(loader) for loader in loaders]
    everything = [i for batches in per_rank for i in flat(batches)]
    assert sorted(everything) == list(range(n))  # disjoint, complete, no padding
    assert [len(loader) for loader in loaders] == [len(p) for p in per_rank]
    # resume rank r at a global offset saved by rank 0 after 5 batches
    ref0 = ResumableLoader(Indexed(n), b, seed=9, epochs=1, rank=0, world_size=world_size)
    list(itertools.islice(ref0, 5))
    state = ref0.state_dict()
    assert state == {"epoch": 0, "offset": 5 * b * world_size}
    for r in range(world_size):
        loader = ResumableLoader(Indexed(n), b, seed=9, epochs=1, rank=r, world_size=world_size)
        loader.load_state_dict(state)
        assert [x.tolist() for x in loader] == [x.tolist() for x in per_rank[r][5:]]


def test_loader_drop_last_same_batch_count_on_all_ranks():
    n, b, w = 1019, 10, 2
    counts = [len(list(ResumableLoader(Indexed(n), b, drop_last=True, epochs=1, rank=r, world_size=w))) for r in range(w)]
    assert counts == [n // (b * w)] * w


def test_loader_does_not_touch_global_rng_and_works_with_workers():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = ResumableLoader(Indexed(20), 4, seed=3, epochs=1, num_workers=2)
    batches = [b.tolist() for b in loader]
    assert torch.equal(before, torch.get_rng_state())
    assert batches == [b.tolist() for b in ResumableLoader(Indexed(20), 4, seed=3, epochs=1)]


def test_loader_rejects_bad_state():
    loader = ResumableLoader(Indexed(5), 2)
    with pytest.raises(ValueError, match="epoch"):
        loader.load_state_dict({"offset": 1})
    with pytest.raises(ValueError):
        loader.load_state_dict({"epoch": -1, "offset": 0})
