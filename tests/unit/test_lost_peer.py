"""A bystander rank (its collective failed because another rank's process ended) waits for the
launcher, so that torchrun names the rank that failed first (the process test:
tests/processes/test_distributed_launch.py::test_a_rank_raising_ends_the_job_with_its_error_and_rank)."""

from __future__ import annotations

import time

from cadence.runtime.lost_peer import lost_a_peer, wait_for_the_launcher

GLOO = ("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7602. "
        "This is typically caused by a remote worker crashing.")


def test_a_collectives_error_for_a_lost_peer_is_told_apart_also_when_wrapped():
    assert lost_a_peer(RuntimeError(GLOO))
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as e:
            raise ValueError("the loop failed") from e
    except ValueError as wrapped:
        assert lost_a_peer(wrapped)
    assert not lost_a_peer(RuntimeError("planted failure on rank 1"))


def test_only_a_bystander_under_torchrun_waits(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    start = time.monotonic()
    wait_for_the_launcher(RuntimeError(GLOO), seconds=5)  # no launcher to wait for
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    wait_for_the_launcher(RuntimeError("planted failure"), seconds=5)  # the rank that failed first
    assert time.monotonic() - start < 1
    start = time.monotonic()
    wait_for_the_launcher(RuntimeError(GLOO), seconds=0.2)
    assert time.monotonic() - start >= 0.2
