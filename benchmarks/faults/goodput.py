"""Goodput under failures: the fraction of wall time spent on training steps that the final model
kept, for a 2-rank ``cadence train --nproc 2 --max-restarts K`` run whose ranks are killed
(SIGKILL, a random rank) every N seconds, next to the same run without faults.

    OMP_NUM_THREADS=1 python benchmarks/faults/goodput.py [--quick] [--out benchmarks/results/goodput.md]

Kept-step time is read from the run's ``train/metrics.jsonl``: the records of the final history
only (a restarted run drops what a killed one wrote past its restored checkpoint), each loop's
steps / its ``steps_per_second``. The rest of the wall time is the steps computed and lost (run by
an attempt after its last commit; counted by the Task), and everything else: each attempt's start
(processes, imports, process group, restore), checkpoint saves, noticing the failure and stopping
the survivors. A kill tick that finds no rank up (the job is restarting) is skipped. Both runs
must end with bit-identical weights (checked). ``benchmarks/run.py`` runs it as ``goodput``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.common.results_file import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASK = f"{HERE / 'goodput_task.py'}:GoodputTask"

FULL = {"steps": 1000, "step_time": 0.05, "steps_per_loop": 10, "checkpoint_interval": 50, "kill_every": 20.0}
QUICK = {"steps": 100, "step_time": 0.03, "steps_per_loop": 10, "checkpoint_interval": 20, "kill_after_steps": 25,
         "max_kills": 1}
"""The smoke test's run: instead of a kill every N seconds (how many land depends on the machine's speed), a rank
of each of the first ``max_kills`` attempts is killed once that attempt has run ``kill_after_steps`` steps: always
one kill here, which loses the steps since the attempt's last commit."""
MAX_RESTARTS = 100


def _config(path: Path, attempts: Path, p: dict, task: str = TASK) -> Path:
    import yaml

    cfg = {"task": {"class": task, "params": {"attempt_dir": str(attempts), "step_time": p["step_time"]}},
           "trainer": {"train_steps": p["steps"], "steps_per_loop": p["steps_per_loop"],
                       "checkpoint_interval": p["checkpoint_interval"], "in_process_validation": False,
                       "max_to_keep": 2, "seed": 1}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _alive(pid: int) -> bool:
    try:
        return "cadence" in Path(f"/proc/{pid}/cmdline").read_text() and \
            Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _newest_attempt(attempts: Path) -> int | None:
    """torchrun's restart count of the newest attempt whose ranks have started (None before the first)."""
    numbers = {int(p.name[7:].split("-")[0]) for p in attempts.glob("attempt*-rank*") if p.suffix != ".tmp"}
    return max(numbers) if numbers else None


def _steps_of(attempts: Path, attempt: int) -> int:
    """The train steps rank 0 of ``attempt`` has run so far."""
    try:
        return int((attempts / f"steps{attempt}-rank0").read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _current_ranks(attempts: Path) -> dict[int, int]:
    """The live worker pids of the newest attempt that has started ({} while none is up)."""
    newest = _newest_attempt(attempts)
    if newest is None:
        return {}
    pids = {}
    for path in attempts.glob(f"attempt{newest}-rank*"):
        if path.suffix != ".tmp":
            pid = int(path.read_text())
            if _alive(pid):
                pids[int(path.name.rsplit("rank", 1)[1])] = pid
    return pids


def final_records(model_dir: Path) -> list[dict]:
    """``train/metrics.jsonl``'s final history: the last record of each step, by step."""
    records: dict[int, dict] = {}
    for line in (model_dir / "train" / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        records[record["step"]] = record
    return [records[s] for s in sorted(records)]


def _kept_step_seconds(model_dir: Path) -> tuple[float, int]:
    """Seconds of the training loops in the final history, and their steps (``metrics.jsonl``)."""
    seconds, previous = 0.0, 0
    for record in final_records(model_dir):
        seconds += (record["step"] - previous) / record["steps_per_second"]
        previous = record["step"]
    return seconds, previous


def _kill_due(attempts: Path, p: dict, kills: list[dict], killed: set[int]) -> bool:
    """For a run with ``kill_after_steps``: whether the newest attempt, not killed yet, has run that many steps
    (at most ``max_kills`` kills); ``killed`` holds the attempts already killed."""
    newest = _newest_attempt(attempts)
    return (newest is not None and newest not in killed and len(kills) < p["max_kills"]
            and _steps_of(attempts, newest) >= p["kill_after_steps"])


def one_run(work: Path, p: dict, rng: random.Random, *, faults: bool = False) -> dict:
    """One ``cadence train --nproc 2`` run to the end; with ``faults``, its ranks killed every ``kill_every`` s
    (or, with ``kill_after_steps`` in ``p``, once each attempt has run that many steps, ``max_kills`` times)."""
    kill_every = p.get("kill_every")
    work.mkdir(parents=True)
    attempts = work / "attempts"
    attempts.mkdir()
    model_dir = work / "run"
    cfg = _config(work / "config.yaml", attempts, p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    kills: list[dict] = []
    killed: set[int] = set()
    skipped = 0
    log = work / "output.txt"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cadence", "train", str(cfg), "--model-dir", str(model_dir),
                                 "--nproc", "2", "--no-progress", "--max-restarts", str(MAX_RESTARTS)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            tick = start + kill_every if faults and kill_every else None
            while proc.poll() is None:
                now = time.monotonic()
                if faults and "kill_after_steps" in p and _kill_due(attempts, p, kills, killed):
                    ranks = _current_ranks(attempts)
                    if ranks:
                        rank = rng.choice(sorted(ranks))
                        killed.add(_newest_attempt(attempts) or 0)
                        os.kill(ranks[rank], signal.SIGKILL)
                        kills.append({"t_s": round(now - start, 2), "rank": rank})
                if tick is not None and now >= tick:
                    tick += kill_every
                    ranks = _current_ranks(attempts)
                    if ranks:
                        rank = rng.choice(sorted(ranks))
                        os.kill(ranks[rank], signal.SIGKILL)
                        kills.append({"t_s": round(now - start, 2), "rank": rank})
                    else:
                        skipped += 1
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait()
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the run in {work} failed (status {proc.returncode}):\n" + log.read_text()[-4000:])
    kept_s, kept_steps = _kept_step_seconds(model_dir)
    steps_run = sum(int(f.read_text().strip() or 0) for f in attempts.glob("steps*-rank0"))
    n_attempts = len(list(attempts.glob("steps*-rank0")))
    step_s = kept_s / kept_steps
    lost_steps = steps_run - kept_steps
    return {"wall_s": wall, "kills": kills, "skipped_ticks": skipped, "restarts": n_attempts - 1,
            "steps_run": steps_run, "steps_kept": kept_steps, "lost_steps": lost_steps,
            "kept_step_s": kept_s, "lost_step_s": lost_steps * step_s,
            "other_s": wall - kept_s - lost_steps * step_s, "goodput": kept_s / wall,
            "weights": str(model_dir / "checkpoints" / f"ckpt-{kept_steps}" / "model.safetensors")}


def _same_weights(a: str, b: str) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(quick: bool = False, root: str | None = None, seed: int = 0) -> dict:
    """The run without faults, then the one with its ranks killed (:func:`fault_text`)."""
    p = QUICK if quick else FULL
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(dir=root, prefix="cadence-goodput-") as tmp:
        clean = one_run(Path(tmp, "clean"), p, rng)
        faulty = one_run(Path(tmp, "faulty"), p, rng, faults=True)
        identical = _same_weights(clean.pop("weights"), faulty.pop("weights"))
    if not identical:
        raise RuntimeError("the run with faults did not end with the weights of the run without")
    return {"quick": quick, **p, "ranks": 2, "max_restarts": MAX_RESTARTS, "identical_weights": identical,
            "clean": clean, "faulty": faulty, "goodput_ratio": faulty["goodput"] / clean["goodput"]}


def fault_text(r: dict) -> str:
    """When the faulty run's ranks are killed: ``a rank killed every 20 s``."""
    if "kill_after_steps" in r:
        times = "once" if r["max_kills"] == 1 else f"{r['max_kills']} times"
        return f"a rank killed after {r['kill_after_steps']} steps, {times}"
    return f"a rank killed every {r['kill_every']:g} s"


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## Goodput under failures ({r['ranks']} ranks, gloo, CPU; {r['steps']} steps of {r['step_time'] * 1000:.0f} ms, "
              f"a checkpoint every {r['checkpoint_interval']} steps; {fault_text(r)} (a random one, SIGKILL), "
              f"--max-restarts {r['max_restarts']}{', quick' if r.get('quick') else ''})\n"),
             "| run | wall s | kills | restarts | steps run | lost steps | kept-step time s | lost-step time s | "
             "other s | goodput |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, key in (("no faults", "clean"), (fault_text(r), "faulty")):
        x = r[key]
        lines.append(f"| {name} | {x['wall_s']:.1f} | {len(x['kills'])} | {x['restarts']} | {x['steps_run']} | "
                     f"{x['lost_steps']} | {x['kept_step_s']:.1f} | {x['lost_step_s']:.1f} | {x['other_s']:.1f} | "
                     f"{x['goodput'] * 100:.1f}% |")
    lines.append(f"\nGoodput: the time of the training loops whose steps the final model kept (from "
                 f"`train/metrics.jsonl`) / wall time, from `cadence train` starting to its exit. With faults: "
                 f"{r['goodput_ratio'] * 100:.1f}% of the fault-free goodput. Lost steps: run after an attempt's last "
                 f"commit and redone. Other: starting each attempt (processes, imports, process group, restore), "
                 f"checkpoint saves, noticing a failure and stopping the other rank. Final weights bit-identical to "
                 f"the run without faults: {'yes' if r['identical_weights'] else 'NO'}.\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--seed", type=int, default=0, help="which rank each kill picks")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    result = run(quick=args.quick, seed=args.seed)
    print(json.dumps(result, indent=1))
    text = "\n".join(markdown_lines(result))
    print(text)
    write_results(args.out, text, result)


if __name__ == "__main__":
    main()
