"""The writer's note of the steps its retention deleted (``.leases/deleted-steps``:
``Leases.record_deleted`` / ``Leases.deleted``): merged, kept to the newest, never read as a lease,
and an unreadable note is no step at all (and is rewritten)."""

from __future__ import annotations

import logging

from cadence import Controller
from cadence.checkpoint import CheckpointManager
from cadence.checkpoint.leases import Leases
from fakes import FakeTrainer


def test_notes_merge_and_keep_the_newest(tmp_path, monkeypatch):
    import cadence.checkpoint.leases as leases_module

    leases = Leases(str(tmp_path))
    assert leases.deleted() == []
    leases.record_deleted([4, 2])
    leases.record_deleted([])
    leases.record_deleted([6, 2])
    assert leases.deleted() == [2, 4, 6]
    monkeypatch.setattr(leases_module, "DELETED_KEPT", 2)
    leases.record_deleted([8])
    assert leases.deleted() == [6, 8]
    assert leases.read_all() == [] and leases.remove_expired(grace=0, now=1e12) == []  # no lease, never removed


def test_an_unreadable_note_is_read_as_none_and_rewritten(tmp_path, caplog):
    leases = Leases(str(tmp_path))
    (tmp_path / ".leases").mkdir()
    (tmp_path / ".leases" / "deleted-steps").write_text('{"steps": ["x"]}')
    with caplog.at_level(logging.WARNING, logger="cadence"):
        assert leases.deleted() == []
    assert "ignoring unreadable note" in caplog.text
    leases.record_deleted([2])
    assert leases.deleted() == [2]


def test_retention_notes_what_it_deletes_before_deleting(tmp_path):
    manager = CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=1)
    Controller(trainer=FakeTrainer(), checkpoint_manager=manager, steps_per_loop=2, checkpoint_interval=2,
               progress=False).train(6)
    assert manager.steps() == [6]
    assert Leases(str(tmp_path / "checkpoints")).deleted() == [2, 4]
