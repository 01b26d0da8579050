"""``trainer.fault_tolerance`` in one process: its form at load, the replica id from the config or the
environment, the context's data split over every group (a group of one rank or several), and the
refusals that come before torchft (one line each)."""

from __future__ import annotations

import re
import socket

import pytest
from pydantic import ValidationError

from cadence.config.components.fault_tolerance import REPLICA_ID_ENV, FaultToleranceConfig
from cadence.config.trainer import TrainerConfig
from cadence.errors import ConfigError
from cadence.torch import Context
from cadence.torch.fault_tolerance import join_replica_groups
from cadence.torch.fault_tolerance.manager import lighthouse_address


@pytest.mark.parametrize("fields, message", [
    ({"replica_groups": 0}, "replica_groups must be >= 1, got 0"),
    ({"replica_groups": 2, "min_replicas": 3}, "min_replicas (3) exceeds replica_groups (2)"),
    ({"replica_groups": 2, "replica_id": 2}, "replica_id 2 is not below replica_groups (2)"),
    ({"replica_groups": 2, "timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ({"replica_groups": 2, "heartbeat_timeout_s": -1}, "heartbeat_timeout_s must be > 0, got -1"),
    ({"replica_groups": "2"}, "replica_groups\n  Input should be a valid integer"),
    ({"replica_groups": 2, "lighthous": "x"}, "lighthous\n  Extra inputs are not permitted"),
])
def test_bad_settings_are_refused_at_load(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        FaultToleranceConfig(**fields)


def test_absent_it_is_off_and_present_it_holds_its_defaults():
    assert TrainerConfig().fault_tolerance is None  # existing configs: exact resume only
    ft = TrainerConfig(fault_tolerance={"replica_groups": 3}).fault_tolerance
    assert ft is not None and (ft.replica_groups, ft.min_replicas, ft.replica_id, ft.lighthouse) == (3, 1, None, None)


@pytest.fixture
def lighthouse(monkeypatch):
    """A listening socket as the lighthouse (``TORCHFT_LIGHTHOUSE``): join_replica_groups checks that it
    accepts connections."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{listening.getsockname()[1]}")
        yield


def test_the_replica_id_comes_from_the_config_else_the_environment(monkeypatch, lighthouse):
    monkeypatch.delenv(REPLICA_ID_ENV, raising=False)
    ctx = Context()
    assert join_replica_groups(FaultToleranceConfig(replica_groups=3, replica_id=2), ctx) == 2
    assert (ctx.replica_group, ctx.replica_groups, ctx.data_shard()) == (2, 3, (2, 3))
    monkeypatch.setenv(REPLICA_ID_ENV, "1")
    assert join_replica_groups(FaultToleranceConfig(replica_groups=3), Context()) == 1
    for bad in ("3", "-1", "one"):
        monkeypatch.setenv(REPLICA_ID_ENV, bad)
        with pytest.raises(ConfigError, match=f"an integer from 0 to 2; got '{bad}'"):
            join_replica_groups(FaultToleranceConfig(replica_groups=3), Context())


def test_a_group_of_several_ranks_joins_and_a_lighthouse_address_is_required(monkeypatch, lighthouse):
    class Coordinator:  # a context of 2 ranks needs one; nothing is called on it
        rank, world_size = 1, 2

    ctx = Context(rank=1, world_size=2, coordinator=Coordinator())  # type: ignore[arg-type]
    assert join_replica_groups(FaultToleranceConfig(replica_groups=2, replica_id=1), ctx) == 1
    assert ctx.data_shard() == (3, 4)  # group 1's rank 1: after group 0's 2 ranks
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="no lighthouse address"):
        lighthouse_address(FaultToleranceConfig(replica_groups=2))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:1")
    assert lighthouse_address(FaultToleranceConfig(replica_groups=2)) == "http://h:1"
    assert lighthouse_address(FaultToleranceConfig(replica_groups=2, lighthouse="http://c:2")) == "http://c:2"


def test_without_replica_groups_the_data_split_is_the_data_parallel_ranks():
    class Coordinator:
        rank, world_size = 1, 4

    ctx = Context(rank=1, world_size=4, coordinator=Coordinator())  # type: ignore[arg-type]
    assert ctx.data_shard() == (1, 4)
    ctx.replica_group, ctx.replica_groups = 1, 2
    assert ctx.data_shard() == (5, 8)  # group 1's rank 1: after group 0's 4 ranks
