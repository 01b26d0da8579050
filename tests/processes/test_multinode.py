"""Two torchrun nodes on 127.0.0.1 (``cadence train ... --nnodes 2 --node-rank I --rdzv-endpoint``, one
process each) train one job: bit-identical to one node with 2 processes; a node lost mid-run (its agent's
process group and its worker killed with SIGKILL, as a machine dies) is restarted with ``--max-restarts`` and
the job still ends bit-identical; without restarts the other node fails in one line naming the lost node and
rank, and no process is left behind; a finished node does not wait 300 s for a dead peer agent; the sidecar
runs as a third process on the same model dir, local and on the S3 test server.

The jobs run without ``OMP_NUM_THREADS`` (:data:`multinode.NODE_ENV`), with layers wide enough that a CPU
matrix product's result depends on its threads (``hidden: 64, outputs: 10``): torch's launcher alone would
give a node of 2 processes 1 thread each and a node of 1 process all the cores, and the layouts' weights
would differ."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_run import ENV, alive, checkpoint_weights, popen, run_python, same_weights
from configs import write_config
from multinode import FAST_RDZV, NODE_ENV, free_port, kill_node, listening, start_node, stop_nodes, wait_until

STEPS = 24
STEP_SLEEP = 0.05  # 24 steps: over a second of training, so that a test can act mid-run
EVALUATED = [(step, "evaluated") for step in (8, 16, 24)]


def config(tmp_path: Path, *, step_sleep: float = STEP_SLEEP, steps: int = STEPS, hold_after: int | None = None) -> Path:
    (tmp_path / "attempts").mkdir(parents=True, exist_ok=True)
    return write_config(tmp_path, "multinode_tasks.py:NodeTask",
                        params={"n": 256, "hidden": 64, "outputs": 10, "attempt_dir": str(tmp_path / "attempts"),
                                "step_sleep": step_sleep, "hold_after": hold_after},
                        trainer={"train_steps": steps, "steps_per_loop": 4, "checkpoint_interval": 8,
                                 "in_process_validation": False, "max_to_keep": None, "seed": 1},
                        sidecar={"mode": "every", "poll_interval": 0.05, "timeout": 120})


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of the same job on one node with 2 processes (without OMP_NUM_THREADS too)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_python(["-m", "cadence", "train", str(config(tmp, step_sleep=0.0)), "--model-dir", str(tmp / "run"),
                       "--nproc", "2", "--no-progress"], env=NODE_ENV, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp / "run" / "checkpoints" / "FINAL").read_text())["step"] == STEPS
    return checkpoint_weights(tmp / "run" / "checkpoints" / f"ckpt-{STEPS}")


class Nodes:
    """The two nodes of one job, each ``cadence train`` in a session of its own with its output in a file;
    node 0 starts first, so that it hosts the rendezvous store."""

    def __init__(self, tmp_path: Path, cfg: Path, model_dir: str, *, max_restarts: int | None = None,
                 env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> None:
        self.tmp, self.cfg, self.model_dir, self.max_restarts, self.env = tmp_path, cfg, model_dir, max_restarts, env
        self.extra = extra
        self.attempts = tmp_path / "attempts"
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.workers: set[int] = set()
        self.start(0)
        self.wait_for("node 0's rendezvous store", lambda: listening(self.port))
        self.start(1)

    def start(self, node: int) -> None:
        log = self.tmp / f"node{node}-{len(self.logs)}.txt"
        with open(log, "w") as out:
            self.procs[node] = start_node(self.cfg, self.model_dir, node, 2, self.port,
                                          max_restarts=self.max_restarts, env=self.env, extra=self.extra, stdout=out)
        self.logs.append(log)

    def wait_for(self, what: str, ready, timeout: float = 120):
        return wait_until(what, ready, timeout=timeout, procs=list(self.procs.values()), logs=self.logs)

    def ranks(self, attempt: int) -> dict[int, dict]:
        """node -> its rank's ``{"rank", "pid", "agent"}`` in ``attempt``, once both are up."""
        def both():
            files = [self.attempts / f"attempt{attempt}-node{n}.json" for n in (0, 1)]
            return {n: json.loads(f.read_text()) for n, f in enumerate(files)} if all(f.exists() for f in files) \
                else None
        found = self.wait_for(f"the ranks of attempt {attempt}", both)
        self.workers |= {r["pid"] for r in found.values()}
        return found

    def output(self, node: int) -> str:
        return "".join(log.read_text() for log in self.logs if log.name.startswith(f"node{node}-"))

    def stop(self) -> None:
        stop_nodes(list(self.procs.values()), sorted(self.workers))


def ended(proc: subprocess.Popen, timeout: float, output) -> int:
    """``proc``'s exit status; fails with the tail of ``output()`` when it has not ended within ``timeout`` s."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s:\n{output()[-6000:]}")


def sidecar(cfg: Path, model_dir: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cadence evaluate CFG --model-dir MODEL_DIR --continuous``, a third process, its output in ``log``."""
    with open(log, "w") as out:
        return popen(["-m", "cadence", "evaluate", str(cfg), "--model-dir", model_dir, "--continuous"],
                     env={**ENV, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_two_nodes_train_as_one_and_a_finished_node_does_not_wait_for_a_dead_peer(tmp_path, reference):
    """Node 1's agent is stopped (SIGSTOP) while its worker trains, so it never reaches torch's exit
    barrier: node 0, whose worker finished, waits for it only $CADENCE_EXIT_BARRIER_S (2 s here; torch's
    own: 300 s) and exits 0. The job is bit-identical to one node's; a sidecar evaluates every checkpoint
    meanwhile, as a third process."""
    model_dir = tmp_path / "run"
    cfg = config(tmp_path)
    log = tmp_path / "sidecar.txt"
    evaluator = sidecar(cfg, str(model_dir), log)
    nodes = Nodes(tmp_path, cfg, str(model_dir), env={"CADENCE_EXIT_BARRIER_S": "2"})
    try:
        ranks = nodes.ranks(0)
        os.kill(ranks[1]["agent"], signal.SIGSTOP)
        nodes.wait_for("both workers to end", lambda: not any(alive(r["pid"]) for r in ranks.values()))
        assert ended(nodes.procs[0], 30, lambda: nodes.output(0)) == 0, nodes.output(0)[-5000:]  # not 300 s
        assert nodes.procs[1].poll() is None  # node 1 never finished: its agent is stopped
        assert evaluator.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        nodes.stop()
        if evaluator.poll() is None:
            os.killpg(evaluator.pid, signal.SIGKILL)
            evaluator.wait()
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == STEPS
    assert same_weights(checkpoint_weights(model_dir / "checkpoints" / f"ckpt-{STEPS}"), reference)
    rows = [json.loads(line) for line in (model_dir / "eval" / "evaluations.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"]) for r in rows] == EVALUATED, rows


def test_a_lost_node_comes_back_and_the_job_ends_bit_identical_on_s3(tmp_path, reference, s3_server):
    """Both nodes with --max-restarts 2, the model dir and a sidecar on the S3 test server: node 1's
    process group and its worker are killed with SIGKILL mid-run, as a machine dies, and node 1 is started
    again, as a scheduler would: the job resumes from its last commit and ends bit-identical."""
    import s3fs
    from safetensors.torch import load as load_safetensors

    url = f"s3://{s3_server.bucket()}/run"
    cfg = config(tmp_path, hold_after=8)  # the first workers wait after step 8 (committed) until released
    log = tmp_path / "sidecar.txt"
    evaluator = sidecar(cfg, url, log, env=s3_server.env())
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

    def committed() -> list[int]:
        return sorted(int(p.rsplit("-", 1)[1].split("/")[0]) for p in fs.glob(f"{url}/checkpoints/ckpt-*/MANIFEST.json"))

    nodes = Nodes(tmp_path, cfg, url, max_restarts=2, env=s3_server.env(), extra=FAST_RDZV)
    try:
        ranks = nodes.ranks(0)
        nodes.wait_for("a first commit", lambda: committed())
        kill_node(nodes.procs[1], [ranks[1]["pid"]])  # mid-run: both first workers hold at step 9
        (nodes.attempts / "release").touch()
        nodes.start(1)
        assert ended(nodes.procs[0], 180, lambda: nodes.output(0)) == 0, nodes.output(0)[-6000:]
        assert ended(nodes.procs[1], 120, lambda: nodes.output(1)) == 0, nodes.output(1)[-6000:]
        assert evaluator.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert os.path.exists(nodes.attempts / "attempt1-node0.json")  # node 0 restarted its worker
    finally:
        nodes.stop()
        if evaluator.poll() is None:
            os.killpg(evaluator.pid, signal.SIGKILL)
            evaluator.wait()
    out = nodes.output(0)
    assert "torchrun restarted the job after a failure (restart 1 of --max-restarts 2)" in out + nodes.output(1)
    assert json.loads(fs.cat(f"{url}/checkpoints/FINAL"))["step"] == STEPS
    assert same_weights(load_safetensors(fs.cat(f"{url}/checkpoints/ckpt-{STEPS}/model.safetensors")), reference)
    rows = [json.loads(line) for line in fs.cat(f"{url}/eval/evaluations.jsonl").decode().splitlines()]
    assert [(r["step"], r["status"]) for r in rows] == EVALUATED, rows


def test_without_restarts_the_other_node_fails_naming_the_lost_node_and_nothing_is_left(tmp_path):
    """Only node 1's process group is killed (cadence train and torch's agent): its worker, in a session of
    its own, ends with its agent; node 0 fails within seconds, in one line naming node 1 and its rank."""
    cfg = config(tmp_path, steps=400)  # far longer than the test: node 1's worker would train on
    nodes = Nodes(tmp_path, cfg, str(tmp_path / "run"))
    try:
        ranks = nodes.ranks(0)
        nodes.wait_for("training", lambda: (tmp_path / "run" / "checkpoints" / "ckpt-8" / "MANIFEST.json").exists())
        killed = time.monotonic()
        kill_node(nodes.procs[1])
        wait_until("node 1's worker to end with its agent", lambda: not alive(ranks[1]["pid"]), timeout=5)
        code = nodes.procs[0].wait(timeout=60)
        elapsed = time.monotonic() - killed
        assert not any(alive(r["pid"]) or alive(r["agent"]) for r in ranks.values())  # no worker, no agent left
    finally:
        nodes.stop()
    out = nodes.output(0)
    assert code != 0, out[-5000:]
    assert elapsed < 30, out[-5000:]
    failed = [line for line in out.splitlines() if line.startswith("cadence: failed:")]
    assert len(failed) == 1 and failed[0] == out.strip().splitlines()[-1], out[-5000:]
    rank = ranks[1]["rank"]
    assert re.match(rf"cadence: failed: node 1 \(rank {rank} on \S+\) was lost: its processes stopped answering "
                    r"\(no heartbeat for \d+ s\), and the ranks on this node lost their connection to it; "
                    r"the job was not restarted \(--max-restarts 0; ", failed[0]), failed[0]
    assert not (tmp_path / "run" / "checkpoints" / "FINAL").exists()
