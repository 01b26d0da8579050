"""Surviving failures on 2 ranks (``cadence train --nproc 2 --max-restarts K``, torchrun's elastic
agent, gloo on CPU): ranks killed with SIGKILL at random moments are restarted from the latest
committed checkpoint and the run ends bit-identical to an uninterrupted one; once the K restarts
are used up, cadence's one-line error names the rank and the signal; a rank whose training step
blocks is ended by its hang watchdog (``trainer.hang_timeout``), which reports where it is stuck."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_run import checkpoint_weights, ENV, popen, run_python, same_weights
from configs import write_config as tiny_config

TASK = f"{Path(__file__).parents[1] / 'elastic_tasks.py'}:ElasticTask"
STEPS = 120


def config(tmp_path: Path, steps: int = STEPS, *, hang_timeout: float | None = None, **params) -> Path:
    (tmp_path / "attempts").mkdir(exist_ok=True)
    return tiny_config(tmp_path, TASK, params={"n": 512, "attempt_dir": str(tmp_path / "attempts"), **params},
                       trainer={"train_steps": steps, "steps_per_loop": 4, "checkpoint_interval": 8,
                                "validation_interval": 8, "max_to_keep": None, "seed": 1, "hang_timeout": hang_timeout})


class Job:
    """``cadence train CONFIG --nproc 2 ...`` in its own session, its output in a file."""

    def __init__(self, tmp_path: Path, cfg: Path, *args: str) -> None:
        self.model_dir = tmp_path / "run"
        self.attempts = tmp_path / "attempts"
        self.log = tmp_path / "output.txt"
        with open(self.log, "w") as out:
            self.proc = popen(
                ["-m", "cadence", "train", str(cfg), "--model-dir", str(self.model_dir), "--nproc", "2",
                 "--no-progress", *args],
                stdout=out, stderr=subprocess.STDOUT, env={**ENV, "COLUMNS": "200"}, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, what: str, ready, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            assert self.proc.poll() is None, f"the job ended (status {self.proc.returncode}) before {what}:\n" + \
                self.output()[-5000:]
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + self.output()[-5000:]
            time.sleep(0.02)

    def pids(self, attempt: int) -> dict[int, int]:
        """The worker pids of ``attempt`` (torchrun's restart count), once both ranks are up."""
        def both():
            files = [self.attempts / f"attempt{attempt}-rank{r}" for r in (0, 1)]
            return {r: int(f.read_text()) for r, f in enumerate(files)} if all(f.exists() for f in files) else None
        return self.wait_for(f"the ranks of attempt {attempt}", both)

    def committed(self) -> list[int]:
        ckpts = self.model_dir / "checkpoints"
        if not ckpts.exists():
            return []
        return sorted(int(p.name[5:]) for p in ckpts.iterdir()
                      if re.fullmatch(r"ckpt-\d+", p.name) and (p / "MANIFEST.json").exists())

    def wait_for_a_commit(self, after: int) -> int:
        """Wait for a checkpoint past step ``after`` to be committed; its step."""
        return self.wait_for(f"a checkpoint past step {after}",
                             lambda: next((s for s in self.committed() if s > after), None))

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        return code, self.output()

    def stop(self) -> None:
        """End what is left of the job (a test that failed half-way): SIGTERM to cadence, which the
        agent passes on to the workers; then SIGKILL to cadence's session and to the workers (each
        in a session of its own) that this job started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for path in self.attempts.glob("attempt*-rank*"):
            pid = int(path.read_text())
            try:
                if "cadence" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The model dir of an uninterrupted 2-rank run of the same experiment (every 8th step kept)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_python(
        ["-m", "cadence", "train", str(config(tmp)), "--model-dir", str(tmp / "run"), "--nproc", "2",
         "--no-progress"], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "run"


def final_weights(model_dir: Path, step: int):
    assert json.loads((model_dir / "checkpoints" / "FINAL").read_text())["step"] == step
    return checkpoint_weights(model_dir / "checkpoints" / f"ckpt-{step}")


def test_ranks_killed_at_random_are_restarted_and_the_run_ends_bit_identical(tmp_path, reference):
    seed = int(os.environ.get("CADENCE_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    victims = [0, 1, rng.choice([0, 1])]  # both ranks die at least once, in a random order
    rng.shuffle(victims)
    job = Job(tmp_path, config(tmp_path, step_sleep=0.04), "--max-restarts", "5")
    kills = []
    try:
        for attempt, rank in enumerate(victims):
            pids = job.pids(attempt)
            resumed_at = max(job.committed(), default=0)  # what this attempt restores
            job.wait_for_a_commit(resumed_at)  # this attempt has made progress ...
            time.sleep(rng.uniform(0, 0.4))  # ... then dies somewhere in a loop, a save, an evaluation
            os.kill(pids[rank], signal.SIGKILL)
            kills.append((attempt, rank, max(job.committed())))
        code, out = job.finish()
    finally:
        job.stop()
    context = f"seed {seed}, kills (attempt, rank, last commit) {kills}:\n{out[-6000:]}"
    assert code == 0, context
    assert sorted(p.name for p in job.attempts.iterdir()) == [
        f"attempt{a}-rank{r}" for a in range(len(victims) + 1) for r in (0, 1)], context
    assert f"torchrun restarted the job after a failure (restart {len(victims)} of --max-restarts 5)" in out, context
    assert same_weights(final_weights(job.model_dir, STEPS), final_weights(reference, STEPS)), context


def test_when_the_restarts_are_used_up_the_error_names_the_rank_and_the_signal(tmp_path):
    job = Job(tmp_path, config(tmp_path, step_sleep=0.04), "--max-restarts", "1")
    try:
        for attempt in (0, 1):
            pids = job.pids(attempt)
            job.wait_for_a_commit(max(job.committed(), default=0))
            os.kill(pids[1], signal.SIGKILL)
        code, out = job.finish()
    finally:
        job.stop()
    assert code == 1, out
    last = [line for line in out.splitlines() if line.startswith("cadence: failed:")]
    assert len(last) == 1 and last[0] == out.strip().splitlines()[-1], out[-4000:]
    assert re.match(rf"cadence: failed: rank 1 \(local rank 1, pid {pids[1]}\) was killed by SIGKILL; .*"
                    r"the job was restarted once already \(--max-restarts 1, all used\)$", last[0]), last[0]
    assert not (job.model_dir / "checkpoints" / "FINAL").exists()


def rank_lines(out: str, rank: int) -> str:
    prefix = f"[rank{rank}]:"
    return "\n".join(line[len(prefix):] for line in out.splitlines() if line.startswith(prefix))


def test_a_hung_rank_is_ended_by_its_watchdog_and_the_job_restarts(tmp_path, reference):
    marker = tmp_path / "hung-once"
    cfg = config(tmp_path, 24, hang_timeout=5.0, hang_rank=1, hang_at=14, hang_marker=str(marker))
    job = Job(tmp_path, cfg, "--max-restarts", "1")
    code, out = job.finish()
    assert code == 0, out[-6000:]
    assert marker.exists()  # rank 1 did block once
    rank1 = rank_lines(out, 1)
    # its watchdog's report, through torchrun's --tee: the phase, the step, the blocking function
    assert re.search(r"rank 1: no progress for \d+ s \(trainer\.hang_timeout=5\) in phase 'train' at step 13; "
                     r"ending this rank \(exit 124\)", " ".join(rank1.split())), out[-8000:]
    assert re.search(r'elastic_tasks\.py", line \d+, in block_forever', rank1), out[-8000:]
    assert "cadence: all threads of the hung rank:" in rank1
    assert "torchrun restarted the job after a failure (restart 1 of --max-restarts 1)" in out
    assert same_weights(final_weights(job.model_dir, 24), checkpoint_weights(reference / "checkpoints" / "ckpt-24"))


def test_a_hang_without_restarts_fails_naming_the_rank_and_the_watchdog(tmp_path):
    cfg = config(tmp_path, 24, hang_timeout=4.0, hang_rank=1, hang_at=1, hang_marker=str(tmp_path / "hung-once"))
    code, out = Job(tmp_path, cfg).finish()
    assert code == 1, out[-4000:]
    last = out.strip().splitlines()[-1]
    # the first rank to give up: rank 1 (stuck), or rank 0 (stuck waiting for it in a collective)
    assert re.match(r"cadence: failed: rank [01] \(local rank [01], pid \d+\) was ended by its hang watchdog "
                    r"\(exit status 124: no progress for trainer\.hang_timeout seconds; .*\); .*"
                    r"the job was not restarted \(--max-restarts 0; ", last), last
    assert "in phase 'train' at step 0" in " ".join(out.split())


def test_the_launcher_records_the_failed_ranks_and_cadence_names_them(tmp_path):
    """``python -m cadence.cli.torchrun_agent`` writes torch's ChildFailedError as JSON, first failure first;
    :func:`failure_message` turns it into cadence's one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from cadence.cli.torchrun import _read_report, failure_message
    from cadence.cli.torchrun_agent import write_report as _write_report

    failures = {0: ProcessFailure(local_rank=0, pid=11, exitcode=-15, error_file="<N/A>"),
                1: ProcessFailure(local_rank=1, pid=12, exitcode=-9, error_file="<N/A>")}
    failures[1].timestamp = failures[0].timestamp - 1  # rank 1 died first
    report = tmp_path / "report.json"
    _write_report(str(report), ChildFailedError("cadence", failures))
    recorded = _read_report(str(report))
    assert [(f["rank"], f["local_rank"], f["pid"], f["exitcode"]) for f in recorded] == [(1, 1, 12, -9), (0, 0, 11, -15)]
    assert failure_message(1, recorded, 3) == (
        "rank 1 (local rank 1, pid 12) was killed by SIGKILL; also ended: rank 0 (SIGTERM); "
        "the job was restarted 3 times already (--max-restarts 3, all used)")
    hang = [{"rank": 2, "local_rank": 0, "pid": 7, "exitcode": 124}]
    assert failure_message(1, hang, 0).startswith(
        "rank 2 (local rank 0, pid 7) was ended by its hang watchdog (exit status 124: no progress for "
        "trainer.hang_timeout seconds; where it was stuck is logged above); the job was not restarted")
    assert failure_message(1, [{"rank": 0, "exitcode": 3}], 1) == (
        "rank 0 exited with status 3; the job was restarted once already (--max-restarts 1, all used)")
    assert _read_report(str(tmp_path / "missing.json")) == []
    assert "torchrun's report above names the failed rank" in failure_message(1, [], 0)
