"""The replica launcher's supervision (``cadence.cluster.replica_groups.run_replica_groups``) with a
real lighthouse and groups that are plain processes: a group that fails is restarted while it has
restarts left; a group refused (exit code 2: bad input, the same again at each start) is not."""

from __future__ import annotations

import io
import sys

import pytest

from cadence.cluster.replica_groups import free_port, lighthouse_program, run_replica_groups

pytest.importorskip("torchft")


def test_a_failed_group_is_restarted_and_a_refused_one_is_not(tmp_path):
    port = free_port()
    argv = [lighthouse_program(), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
    commands = {"group0": [sys.executable, "-c", "import sys; sys.exit(2)"],
                "group1": [sys.executable, "-c", "import sys; sys.exit(1)"]}
    out = io.StringIO()
    codes = run_replica_groups(commands, argv, port, tmp_path / "lighthouse.log", max_restarts=2, grace_s=5.0, out=out)
    text = out.getvalue()
    assert codes == {"group0": 2, "group1": 1, "restarts": 2}, text
    assert "group0 was refused (code 2: bad input, see its error above); not restarting it" in text
    assert "group0 exited with code 2; restarting" not in text
    assert "group1 exited with code 1; restarting it (2 of 2)" in text
    assert "group1 exited with code 1; no restart left (2 made)" in text
