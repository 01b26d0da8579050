"""cadence train's one-line error for a lost node (cadence.cli.node_loss), from what a surviving rank
recorded; the agent's bounded exit barrier (cadence.cli.torchrun_agent)."""

from __future__ import annotations

import json

from cadence.cli.node_loss import lost_message, read_lost
from cadence.cli.torchrun import failure_message


def test_the_lost_node_is_named_when_the_rank_that_found_it_failed(tmp_path):
    path = tmp_path / "lost.json"
    path.write_text(json.dumps({"pid": 11, "silent_s": 2.0, "lost": [
        {"rank": 3, "node": "1", "host": "b"}, {"rank": 2, "node": "1", "host": "b"},
        {"rank": 4, "node": "2", "host": "c"}]}))
    finding = read_lost(str(path))
    failures = [{"rank": 0, "local_rank": 0, "pid": 11, "exitcode": 1}]
    assert failure_message(1, failures, 0, lost=finding) == (
        "nodes 1 (ranks 2, 3 on b) and 2 (rank 4 on c) were lost: their processes stopped answering (no heartbeat "
        "for 2 s), and the ranks on this node lost their connection to them; the job was not restarted "
        "(--max-restarts 0; --max-restarts K restarts it from its last checkpoint)")
    one = {"pid": 11, "silent_s": 2.0, "lost": [{"rank": 1, "node": "1", "host": "b"}]}
    assert lost_message(one, failures) == ("node 1 (rank 1 on b) was lost: its processes stopped answering (no "
                                           "heartbeat for 2 s), and the ranks on this node lost their connection to it")
    # recorded by a rank of an earlier attempt (not among the failed ones): this node's failure is named
    other = [{"rank": 0, "local_rank": 0, "pid": 12, "exitcode": 1}]
    assert failure_message(1, other, 2, lost=finding).startswith("rank 0 (local rank 0, pid 12) exited with status 1")
    for bad in ("", "{}", '{"pid": 1, "lost": []}', "[1]"):
        path.write_text(bad)
        assert read_lost(str(path)) is None
    assert read_lost(str(tmp_path / "missing.json")) is None


def test_the_agent_is_built_with_a_bounded_exit_barrier(monkeypatch):
    import torch.distributed.launcher.api as launcher_api

    from cadence.cli.torchrun_agent import bound_the_exit_barrier

    torch_agent = launcher_api.LocalElasticAgent
    monkeypatch.setattr(launcher_api, "LocalElasticAgent", torch_agent)
    seen = {}
    monkeypatch.setattr(torch_agent, "__init__", lambda self, *a, **kw: seen.update(kw))
    bound_the_exit_barrier(7.0)
    bound_the_exit_barrier(5.0)  # a second call replaces the bound, it does not stack subclasses
    agent = launcher_api.LocalElasticAgent
    assert issubclass(agent, torch_agent) and agent.__mro__[1] is torch_agent
    agent(spec=None)
    assert seen == {"spec": None, "exit_barrier_timeout": 5.0}


def test_the_rendezvous_names_its_events_as_before_without_inspecting_the_stack(monkeypatch):
    """torch's get_method_name (inspect.stack() twice per rendezvous operation) is replaced by one that
    reads the frame: the same names, and no stack inspection."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from cadence.cli.torchrun_agent import name_rendezvous_events_cheaply

    torch_version = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torch_version)

    def record(depth=2):
        return dynamic_rendezvous.get_method_name(depth)

    def join_rendezvous(depth=2):
        return record(depth)

    expected = [join_rendezvous(), join_rendezvous(1), join_rendezvous(3), join_rendezvous(500)]
    assert expected[:2] == ["join_rendezvous", "record"] and expected[3] == "no_method_name"
    name_rendezvous_events_cheaply()
    assert dynamic_rendezvous.get_method_name is not torch_version
    monkeypatch.setattr(inspect, "stack", lambda *a: (_ for _ in ()).throw(AssertionError("inspect.stack() called")))
    assert [join_rendezvous(), join_rendezvous(1), join_rendezvous(3), join_rendezvous(500)] == expected


def test_an_agent_of_several_nodes_lingers_after_bad_input_and_one_of_one_node_does_not():
    from cadence.cli.torchrun_agent import _several_nodes

    assert _several_nodes(["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0"])
    assert _several_nodes(["--nnodes=1:3"]) and not _several_nodes(["--nnodes", "1"])
    assert not _several_nodes(["--standalone", "--nproc-per-node", "2"]) and not _several_nodes(["--nnodes", "x"])
