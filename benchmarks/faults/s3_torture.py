"""kill -9 torture of a model dir on S3: a real S3 API server (moto's server mode) on 127.0.0.1,
``cadence train`` killed with SIGKILL at random instants, over and over, then resumed to the end.

    OMP_NUM_THREADS=1 python benchmarks/faults/s3_torture.py [--kills 20] [--seed 0] [--out results/s3_torture.md]

One run trains a small model (tests/tasks.py's TinyTask) to ``STEPS`` uninterrupted, in a bucket
of its own. The tortured run, in another bucket, is a sequence of ``cadence train`` processes on
one ``s3://`` model dir, each killed with ``kill -9``: every fourth at a uniformly random instant
of its start-up (imports, writer lease, clean-up of the previous victim's leftovers, restore),
the others at a uniformly random instant of the first ``TRAIN_WINDOW`` seconds after training
began (steps, checkpoint saves: files, the conditional-create manifest, retention's deletions).
Saves alternate between synchronous and asynchronous from one process to the next. After every
kill every committed checkpoint is read and verified against its manifest, and a ``ckpt-N/``
left without a manifest (a kill during that save) is counted. Then one last process resumes to
``STEPS``; its final weights must be bit-identical to the uninterrupted run's, and
``train/metrics.jsonl`` must hold each summarized step once, with the same losses.

:func:`torture` is the measurement (tests/processes/test_s3.py runs a 5-kill version); standalone, the
script starts the server, runs it and writes ``results/s3_torture.md`` and ``.json``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

ROOT = Path(__file__).resolve().parents[2]
TASK = f"{ROOT / 'tests' / 'tasks.py'}:TinyTask"
STEPS = 600
STARTUP_EVERY = 4  # every fourth process is killed at a random instant of its start-up
STARTUP_WINDOW = (0.2, 3.5)  # seconds after the process started
TRAIN_WINDOW = 1.5  # seconds after training began
_TRAINING = re.compile(r"restored checkpoint|no checkpoint restored")
_COMMITTED = re.compile(r"ckpt-(0|[1-9][0-9]*)")


def write_config(directory: Path, steps: int) -> Path:
    import yaml

    cfg = {"task": {"class": TASK, "params": {"n": 256, "step_sleep": 0.01}},
           "trainer": {"train_steps": steps, "steps_per_loop": 2, "checkpoint_interval": 4, "validation_interval": 50,
                       "max_to_keep": 3, "seed": 1}}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _command(config: Path, url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cadence", "train", str(config), "--model-dir", url, "--no-progress", *extra]


def _environment(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONPATH": str(ROOT / "src"), **env}


def verify_all(url: str) -> dict[str, Any]:
    """Read and verify every committed checkpoint of model dir ``url`` (raises on a corrupt one);
    also the ``ckpt-N/`` dirs without a manifest (a save interrupted) and those moved aside."""
    from cadence.checkpoint import CheckpointManager

    manager = CheckpointManager(f"{url}/checkpoints", writer=False)
    steps = manager.steps()
    for step in steps:
        manager.read(step)  # CorruptCheckpointError if any byte is off
    names = manager.storage.listdir(manager.storage.root)
    uncommitted = [n for n in names if _COMMITTED.fullmatch(n) and int(n[5:]) not in steps]
    return {"steps": steps, "uncommitted": uncommitted, "quarantined": manager.quarantined()}


def final_weights(url: str, steps: int) -> bytes:
    from cadence.storage import Storage

    storage = Storage(url)
    return storage.read_bytes(storage.join("checkpoints", f"ckpt-{steps}", "model.safetensors"))


def losses(url: str) -> list[tuple[int, float]]:
    from cadence.summaries.metrics_file import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(f"{url}/train")]


def _killed_run(config: Path, url: str, env: dict[str, str], rng: random.Random, *, async_save: bool,
                startup: bool) -> dict[str, Any]:
    """One ``cadence train`` on ``url``, killed with SIGKILL at a random instant (see the module doc)."""
    proc = subprocess.Popen(_command(config, url, "--set", f"checkpoint.async_save={str(async_save).lower()}"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_environment(env))
    started = time.monotonic()
    training = threading.Event()
    tail: list[str] = []

    def watch() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line)
            del tail[:-40]
            if _TRAINING.search(line):
                training.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    if startup:
        delay = rng.uniform(*STARTUP_WINDOW)
        finished = _wait(proc, delay)
    elif _wait_event(proc, training, 120.0):
        delay = rng.uniform(0.0, TRAIN_WINDOW)
        finished = _wait(proc, delay)
    elif proc.poll() is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"cadence train did not start training within 120s:\n{''.join(tail)}")
    else:
        finished = True
    at = time.monotonic() - started
    if not finished:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(10)
    if finished and proc.returncode != 0:
        raise RuntimeError(f"cadence train exited with {proc.returncode} before it was killed:\n{''.join(tail)}")
    return {"killed": not finished, "at_s": round(at, 3), "phase": "start-up" if startup else "training",
            "async_save": async_save, "returncode": proc.returncode}


def _wait(proc: subprocess.Popen[str], seconds: float) -> bool:
    """Sleep ``seconds`` unless ``proc`` ends first; True when it ended."""
    try:
        proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _wait_event(proc: subprocess.Popen[str], event: threading.Event, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not event.wait(0.01):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
    return True


def torture(new_bucket: Any, env: dict[str, str], *, kills: int, steps: int = STEPS, seed: int = 0,
            workdir: Path | None = None, local_reference: bool = False) -> dict[str, Any]:
    """The measurement (module doc): ``new_bucket()`` gives a fresh bucket's name, ``env`` points
    the processes at the S3 server. Raises AssertionError when a committed checkpoint does not
    verify, a checkpoint was moved aside, or the final weights or the metrics differ.

    ``local_reference``: the uninterrupted run trains in a local directory instead of a bucket (the
    test's choice: the same weights and metrics, without a second run's S3 requests)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(workdir or tmp), steps)
        started = time.monotonic()
        straight = str(Path(workdir or tmp) / "reference") if local_reference else f"s3://{new_bucket()}/run"
        proc = subprocess.run(_command(config, straight), capture_output=True, text=True, env=_environment(env),
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        straight_s = time.monotonic() - started

        url = f"s3://{new_bucket()}/run"
        attempts: list[dict[str, Any]] = []
        verified: set[int] = set()
        mid_save = 0
        started = time.monotonic()
        while sum(a["killed"] for a in attempts) < kills:
            attempt = _killed_run(config, url, env, rng, async_save=len(attempts) % 2 == 1,
                                  startup=len(attempts) % STARTUP_EVERY == STARTUP_EVERY - 2)
            found = verify_all(url)
            assert not found["quarantined"], found
            verified.update(found["steps"])
            mid_save += bool(found["uncommitted"])
            attempt.update(committed=found["steps"], uncommitted=found["uncommitted"])
            attempts.append(attempt)
            if not attempt["killed"]:
                break  # it finished first: no more to kill
        killed_s = time.monotonic() - started
        proc = subprocess.run(_command(config, url), capture_output=True, text=True, env=_environment(env), timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        found = verify_all(url)
        assert not found["quarantined"] and not found["uncommitted"], found
        assert found["steps"][-1] == steps, found
        identical = final_weights(url, steps) == final_weights(straight, steps)
        same_metrics = losses(url) == losses(straight)
        assert identical, "the final weights differ from the uninterrupted run's"
        assert same_metrics, "train/metrics.jsonl differs from the uninterrupted run's (steps once each, same losses)"
        return {
            "kills": sum(a["killed"] for a in attempts),
            "kills_in_startup": sum(a["killed"] and a["phase"] == "start-up" for a in attempts),
            "kills_with_async_save": sum(a["killed"] and a["async_save"] for a in attempts),
            "kills_mid_save": mid_save,
            "finished_before_kill": sum(not a["killed"] for a in attempts),
            "checkpoints_verified": len(verified),
            "steps": steps,
            "reached_before_resume": max((a["committed"][-1] for a in attempts if a["committed"]), default=0),
            "bit_identical": identical,
            "metrics_identical": same_metrics,
            "uninterrupted_s": round(straight_s, 1),
            "killed_runs_s": round(killed_s, 1),
            "attempts": attempts,
        }


def markdown(result: dict[str, Any]) -> str:
    r = result
    return (
        "# kill -9 torture on an S3 model dir\n\n"
        f"{r['machine']['cpu']}, {r['machine']['cores']} cores, Python {r['machine']['python']}, torch "
        f"{r['machine']['torch']}, {r['machine']['date']}. S3: moto {r['moto']} server on 127.0.0.1, s3fs {r['s3fs']}. "
        "Reproduce: `OMP_NUM_THREADS=1 python benchmarks/faults/s3_torture.py`.\n\n"
        f"- {r['kills']} `kill -9` of `cadence train` on `s3://…/run` ({r['kills_in_startup']} during start-up, "
        f"{r['kills'] - r['kills_in_startup']} while training; {r['kills_with_async_save']} with asynchronous saves); "
        f"{r['kills_mid_save']} of them left a checkpoint dir without manifest (killed mid-save).\n"
        f"- After each kill every committed checkpoint was read and verified: {r['checkpoints_verified']} distinct "
        "checkpoints, none corrupt, none moved aside.\n"
        f"- The killed runs reached step {r['reached_before_resume']} of {r['steps']}; one more run resumed to the end: "
        f"final weights bit-identical to an uninterrupted run: **{r['bit_identical']}**; train/metrics.jsonl "
        f"(each step once, same losses): **{r['metrics_identical']}**.\n"
        f"- Wall time: uninterrupted run {r['uninterrupted_s']} s; the killed runs {r['killed_runs_s']} s.\n"
    )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "s3_torture.md")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    from importlib.metadata import version

    from benchmarks.common.results_file import machine, write_results
    from s3_server import S3Server

    with S3Server() as server:
        os.environ.update(server.env())
        result = torture(server.bucket, server.env(), kills=args.kills, steps=args.steps, seed=args.seed)
    result.update(machine=machine(), moto=version("moto"), s3fs=version("s3fs"))
    text = markdown(result)
    write_results(args.out, text, result)
    print(text)


if __name__ == "__main__":
    main()
