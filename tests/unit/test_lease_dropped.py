"""The writer's note of the steps retention deleted out of a reader's bounded range
(``Leases.record_dropped`` / ``Leases.dropped``): only bounded ranges, only steps past ``after``,
merged and pruned as ``after`` moves, and an unreadable note is no step at all."""

from __future__ import annotations

import logging

from cadence.checkpoint.leases import Leases


def test_only_a_bounded_range_gets_a_note_of_the_steps_past_after(tmp_path):
    leases = Leases(str(tmp_path))
    leases.write("bounded", after=4, reading=None, ttl=60, max_pending=2)
    leases.write("unbounded", after=-1, reading=None, ttl=60)
    leases.write("latest", after=None, reading=8, ttl=60, max_pending=None)
    leases.record_dropped([2, 4, 6])
    assert leases.dropped("bounded") == [6]
    assert leases.dropped("unbounded") == leases.dropped("latest") == [] == leases.dropped("nobody")


def test_notes_merge_and_drop_what_the_reader_has_passed(tmp_path):
    leases = Leases(str(tmp_path))
    leases.write("eval", after=-1, reading=None, ttl=60, max_pending=1)
    leases.record_dropped([2, 4])
    leases.record_dropped([6])
    assert leases.dropped("eval") == [2, 4, 6]
    leases.write("eval", after=4, reading=None, ttl=60, max_pending=1)
    leases.record_dropped([8])
    assert leases.dropped("eval") == [6, 8]


def test_an_expired_lease_gets_no_note(tmp_path):
    leases = Leases(str(tmp_path))
    lease = leases.write("eval", after=-1, reading=None, ttl=1, max_pending=1)
    leases.record_dropped([2], now=lease.expires + 3600)
    assert leases.dropped("eval") == []


def test_an_unreadable_note_is_rewritten_by_the_writer_and_read_as_none(tmp_path, caplog):
    leases = Leases(str(tmp_path))
    leases.write("eval", after=-1, reading=None, ttl=60, max_pending=1)
    note = tmp_path / ".leases" / "eval.dropped"
    note.write_text('{"steps": ["x"]}')
    with caplog.at_level(logging.WARNING, logger="cadence"):
        assert leases.dropped("eval") == []
    assert "ignoring unreadable note" in caplog.text
    leases.record_dropped([2])
    assert leases.dropped("eval") == [2]
    assert [lease.holder for lease in leases.read_all()] == ["eval"]  # the note is no lease
