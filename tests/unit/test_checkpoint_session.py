"""cadence.checkpoint.session: the controller's checkpoints -- restore, collective save, FINAL,
rollback, the branch check and asynchronous commits -- on a real CheckpointManager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.session import CheckpointSession
from cadence.runtime.coordination import LocalCoordinator
from cadence.errors import CheckpointError
from fakes import MODEL_FILE, FakeTrainer


class Rank1:
    """Rank 1 of 2: it never writes; its collectives return at once."""

    rank, world_size, is_chief = 1, 2, False

    def __init__(self) -> None:
        self.barriers = 0

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        self.barriers += 1

    def broadcast(self, obj, src=0):
        return obj

    def all_gather(self, obj):
        return [obj, obj]


class DataTrainer(FakeTrainer):
    """Keeps a data position that a rollback must not restore."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 0
        self.rolled_back_with: tuple[bool, bool] | None = None

    def load_checkpoint(self, reader, state, restore_data=True, restore_rng=True):
        model = json.loads(reader.read(MODEL_FILE))
        self.step, self.value = model["step"], model["value"]
        self.rolled_back_with = (restore_data, restore_rng)


def session(tmp_path: Path, events: list, coordinator=None, **kw) -> CheckpointSession:
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=None, **kw)
    return CheckpointSession(manager, coordinator or LocalCoordinator(),
                             on_save=lambda p: events.append(("save", Path(p).name)),
                             on_load=lambda p: events.append(("load", Path(p).name)))


def test_without_a_manager_everything_is_a_no_op() -> None:
    none = CheckpointSession(None, LocalCoordinator(), on_save=pytest.fail, on_load=pytest.fail)
    assert none.restore({"trainer": FakeTrainer()}) is None
    assert none.save(3, dict, pytest.fail) is None  # prepare is not even called
    none.complete(3, pytest.fail)
    none.check_branch(2)
    none.reopen_if_final(5)
    none.after_loop()
    none.close()
    with pytest.raises(ValueError, match="needs a checkpoint manager"):
        none.rollback(FakeTrainer())


def test_save_restore_and_complete(tmp_path) -> None:
    events: list = []
    s = session(tmp_path, events)
    trainer = FakeTrainer()
    trainer.train(4)
    prepared: list[int] = []
    path = s.save(4, lambda: {"trainer": trainer}, lambda: prepared.append(4))
    assert Path(path).name == "ckpt-4" and prepared == [4]
    s.complete(4, lambda: s.save(4, lambda: {"trainer": trainer}, lambda: None))
    assert s.manager.final_step() == 4 and s.manager.steps() == [4]
    fresh = FakeTrainer()
    assert s.restore({"trainer": fresh}) == 4 and fresh.step == 4
    assert events == [("save", "ckpt-4"), ("load", "ckpt-4")]  # a step saved twice commits once


def test_a_non_chief_waits_for_the_commit_and_writes_nothing(tmp_path) -> None:
    events: list = []
    rank1 = Rank1()
    s = session(tmp_path, events, coordinator=rank1, writer=False)
    path = s.save(2, pytest.fail, lambda: events.append("prepared"))  # objects() is the chief's
    assert Path(path).name == "ckpt-2" and rank1.barriers == 1
    assert events == ["prepared"] and s.manager.steps() == []


def test_rollback_keeps_the_data_position(tmp_path) -> None:
    events: list = []
    s = session(tmp_path, events)
    trainer = DataTrainer()
    with pytest.raises(CheckpointError, match="cannot roll back: no committed checkpoint"):
        s.rollback(trainer)
    trainer.train(3)
    s.save(3, lambda: {"trainer": trainer}, lambda: None)
    trainer.train(2)
    assert s.rollback(trainer) == 3
    assert trainer.step == 3 and trainer.rolled_back_with == (False, False)
    assert events[-1] == ("load", "ckpt-3")


def test_branch_check_and_reopening_a_final_run(tmp_path) -> None:
    events: list = []
    s = session(tmp_path, events)
    trainer = FakeTrainer()
    for step in (2, 4):
        trainer.train(2)
        s.save(step, lambda: {"trainer": trainer}, lambda: None)
    s.check_branch(4)
    s.check_branch(None)
    with pytest.raises(ValueError, match=r"restore_step=2 with a trainer, but checkpoints \[4\] exist after it"):
        s.check_branch(2)
    s.manager.mark_final(4)
    s.reopen_if_final(4)  # not past the final step: still final
    assert s.manager.final_step() == 4
    s.reopen_if_final(None)  # until the data runs out: no longer final
    assert s.manager.final_step() is None


def test_asynchronous_commits_are_reported_once_in_order(tmp_path) -> None:
    events: list = []
    s = session(tmp_path, events, async_save=True)
    trainer = FakeTrainer()
    for step in (1, 2):
        trainer.train(1)
        s.save(step, lambda: {"trainer": trainer}, lambda: None)  # waits for (and reports) the previous
    s.close()  # waits for the last one
    s.after_loop()
    assert events == [("save", "ckpt-1"), ("save", "ckpt-2")]
