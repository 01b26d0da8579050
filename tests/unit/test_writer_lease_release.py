"""Releasing the writer lease when the disk is full: expected, so it is logged at DEBUG and the run's
own one-line error stands alone; any other failure to release is a WARNING."""

from __future__ import annotations

import errno
import logging

import pytest

from cadence.checkpoint.writer_lease import WriterLease


@pytest.mark.parametrize("error, level", [(OSError(errno.ENOSPC, "No space left on device"), logging.DEBUG),
                                          (OSError(errno.EDQUOT, "Disk quota exceeded"), logging.DEBUG),
                                          (PermissionError(errno.EACCES, "Permission denied"), logging.WARNING)],
                         ids=["disk-full", "quota", "permission"])
def test_a_failed_release_is_a_warning_unless_the_disk_is_full(tmp_path, caplog, monkeypatch, error, level):
    lease = WriterLease.acquire(str(tmp_path / "run"), ttl=30)

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(lease._dir.storage, "write_atomic", refuse)
    with caplog.at_level(logging.DEBUG, logger="cadence"):
        lease.release()
    records = [r for r in caplog.records if "could not release the writer lease" in r.getMessage()]
    assert [r.levelno for r in records] == [level]
    assert lease.lost
