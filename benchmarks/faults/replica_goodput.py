"""Goodput of fault-tolerant replica groups: ``cadence launch --replicas 2`` (one process per group, torchft over
gloo, CPU) whose group 1 is killed (SIGKILL) every N seconds and restarted by the launcher, next to the same run
without faults -- and, side by side in the same benchmark run, today's restart recovery: the same task as a plain
2-rank job (``cadence train --nproc 2 --max-restarts K``) with its rank 1 killed on the same schedule.

    OMP_NUM_THREADS=1 python benchmarks/faults/replica_goodput.py [--quick] [--out benchmarks/results/replica_goodput.md]

The task, model and step time are the other goodput benchmarks' (``goodput_task.py``: a 50 ms sleep stands for
the compute; 32 samples per process and step, so both jobs train a global batch of 64). Every run logs each step
(``steps_per_loop: 1``): the replica run's ``replicas`` is then each step's number of groups.

- Goodput: steps kept / wall, from the launcher (or ``cadence train``) starting to its exit. Every run keeps
  ``steps`` steps, so a faulty run's ``goodput_of_fault_free`` is the fault-free wall over its own. A step that
  group 0 trains alone (group 1 away) is a step kept but half the global batch: samples kept / wall (and its
  ratio) counts that, from group 0's ``replicas`` per step in ``train/metrics.jsonl``.
- Group 1 is the one killed (group 0's chief writes the checkpoints; were it killed, group 1 would take
  the writer lease at its next checkpoint: tests/processes/test_replica_writer.py); a kill tick that finds
  the victim not yet trained again since the last kill, or the run at its end, is skipped.
- Per failure, replica groups: the survivor's *lost time* -- its steps' time beyond a fault-free step (the median
  two-group step of that run) from the kill to the step at which group 1 healed, split into *loss* (the step in
  flight, dropped and run again once the lighthouse forms a quorum without group 1: ``heartbeat_timeout_s``),
  *alone* (its steps without group 1: cheaper, no peer to wait for) and *heal* (the step at which it served its
  state to group 1) -- and the *rejoin time*: the kill to the end of the restarted group's first step, split into
  *restart* (to its process starting: the launcher notices and starts it), *start-up* (imports, data, the run's
  last checkpoint, the lighthouse, the quorum, healing: to the ``healed from a live peer`` line) and the step.
- Per failure, the plain job: its *recovery time*, the kill to the end of the new attempt's first step (every rank
  restarts from the last checkpoint; the steps since it are run again, ``lost steps``).

``trainer.fault_tolerance.heartbeat_timeout_s``: with 2 groups the survivor waits that long after a loss (torchft's
lighthouse forms a quorum only from more than half of the groups it counts as alive), so each faulty replica run is
made once per value of ``heartbeat_timeouts`` (torchft's default 5 s, then 1 s). ``benchmarks/run.py`` runs it as
``replica_goodput``.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.common.results_file import quick_main  # noqa: E402
from benchmarks.faults.goodput import _config, _same_weights, final_records  # noqa: E402
from benchmarks.faults.goodput_nodes import _alive, _mean, _s, _workers  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASK = f"{HERE / 'replica_goodput_task.py'}:ReplicaGoodputTask"
BATCH = 32
"""Samples per process and step (GoodputTask's ``batch_size``)."""

FULL: dict[str, Any] = {"steps": 2400, "step_time": 0.05, "steps_per_loop": 1, "checkpoint_interval": 50,
                        "kill_every": 30.0, "heartbeat_timeouts": [5.0, 1.0]}
QUICK: dict[str, Any] = {"steps": 150, "step_time": 0.03, "steps_per_loop": 1, "checkpoint_interval": 20,
                         "kill_after_steps": 50, "max_kills": 1, "heartbeat_timeouts": [1.0]}
"""The smoke test's run: the victim is killed once, when group 0 (rank 0) has run ``kill_after_steps`` steps."""
MAX_RESTARTS = 100
HEALED = re.compile(r"\[group1\] .*replica group 1 healed from a live peer at step (\d+)")


class _Reader(threading.Thread):
    """Copies the job's output to ``out`` and keeps the arrival time of each ``healed from a live peer`` line."""

    def __init__(self, stream: IO[str], out: IO[str]) -> None:
        super().__init__(daemon=True)
        self.stream, self.out = stream, out
        self.healed: list[tuple[float, int]] = []  # (wall-clock time, the step group 1 healed at)

    def run(self) -> None:
        for line in self.stream:
            now = time.time()
            self.out.write(line)
            match = HEALED.search(line)
            if match:
                self.healed.append((now, int(match[1])))


def _victim(workers: list[dict], replicas: bool, last_kill: float) -> dict | None:
    """The process to kill (group 1's, or the plain job's rank 1): the newest, if it is alive and has trained a
    step since ``last_kill``; else None (the tick is skipped)."""
    mine = [w for w in workers if (w["group"] if replicas else w["rank"]) == 1]
    w = mine[-1] if mine else None
    if w is None or w["first_step"] is None or w["started"] <= last_kill or not _alive(w["pid"]):
        return None
    return w


def one_run(work: Path, p: dict, *, replicas: bool, heartbeat_s: float | None = None, faults: bool = False) -> dict:
    """One run to the end: ``cadence launch --replicas 2`` (``replicas``) or ``cadence train --nproc 2``; with
    ``faults``, the victim killed every ``kill_every`` s (or once group 0 has run ``kill_after_steps``)."""
    import yaml

    work.mkdir(parents=True)
    attempts = work / "attempts"
    attempts.mkdir()
    model_dir = work / "run"
    cfg = _config(work / "config.yaml", attempts, p, TASK)
    if replicas:
        config = yaml.safe_load(cfg.read_text())
        config["trainer"]["fault_tolerance"] = {"replica_groups": 2, "min_replicas": 1,
                                                **({"heartbeat_timeout_s": heartbeat_s} if heartbeat_s else {})}
        cfg.write_text(yaml.safe_dump(config))
        argv = ["launch", str(cfg), "--replicas", "2"]
    else:
        argv = ["train", str(cfg), "--nproc", "2"]
    argv = [sys.executable, "-m", "cadence", *argv, "--model-dir", str(model_dir), "--no-progress",
            "--max-restarts", str(MAX_RESTARTS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    kills: list[dict] = []
    skipped = 0
    started_at = time.time()
    start = time.monotonic()
    with open(work / "output.txt", "w") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                start_new_session=True)
        assert proc.stdout is not None
        reader = _Reader(proc.stdout, out)
        reader.start()
        try:
            tick = start + p["kill_every"] if faults and "kill_every" in p else None
            while proc.poll() is None:
                now = time.monotonic()
                due = False
                if faults and "kill_after_steps" in p and len(kills) < p["max_kills"]:
                    due = any(w["group"] == 0 and w["rank"] == 0 and w["steps"] >= p["kill_after_steps"]
                              for w in _workers(attempts))
                if tick is not None and now >= tick:
                    tick += p["kill_every"]
                    due = True
                if due and not (model_dir / "checkpoints" / "FINAL").exists():
                    victim = _victim(_workers(attempts), replicas, kills[-1]["at"] if kills else 0.0)
                    if victim is not None:
                        os.kill(victim["pid"], signal.SIGKILL)
                        kills.append({"t_s": round(now - start, 2), "at": time.time(), "pid": victim["pid"]})
                    elif "kill_every" in p:
                        skipped += 1
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=10)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the run in {work} failed (status {proc.returncode}):\n"
                           + (work / "output.txt").read_text()[-4000:])
    records = final_records(model_dir)
    steps = [r["step"] for r in records]
    if not steps or steps != list(range(steps[0], p["steps"] + 1)):
        raise RuntimeError(f"{model_dir}: metrics.jsonl does not hold every step to {p['steps']} once "
                           f"({len(steps)} records)")
    workers = _workers(attempts)
    result: dict[str, Any] = {
        "job": "replicas" if replicas else "plain", "heartbeat_timeout_s": heartbeat_s, "faults": faults,
        "wall_s": wall, "started_at": started_at, "kills": kills, "skipped_ticks": skipped,
        "steps_kept": p["steps"], "goodput_steps": p["steps"] / wall,
        "first_step_s": records[0]["time"] - started_at, "last_step_s": records[-1]["time"] - started_at,
        "weights": str(model_dir / "checkpoints" / f"ckpt-{p['steps']}" / "model.safetensors")}
    if replicas:
        result.update(_replica_figures(records, workers, kills, reader.healed))
    else:
        result.update(_plain_figures(records, workers, kills, p["steps"]))
    result["goodput_samples"] = result["samples_kept"] / wall
    return result


def _plain_figures(records: list[dict], workers: list[dict], kills: list[dict], steps: int) -> dict:
    """The plain job's samples kept, steps run (rank 0's, every attempt), its median step (between two records of
    the final history) and each kill's recovery."""
    gaps = [records[i]["time"] - records[i - 1]["time"] for i in range(1, len(records))]
    for kill in kills:
        after = [w for w in workers if w["started"] > kill["at"] and w["first_step"] is not None]
        up = min((w["started"] for w in after), default=None)
        first = min((w["first_step"] for w in after), default=None)
        kill.update({"restart_s": None if up is None else up - kill["at"],
                     "start_s": None if up is None or first is None else first - up,
                     "recover_s": None if first is None else first - kill["at"]})
    steps_run = sum(w["steps"] for w in workers if w["rank"] == 0)
    return {"typical_step_s": statistics.median(gaps), "samples_kept": steps * 2 * BATCH, "steps_run": steps_run,
            "lost_steps": steps_run - steps,
            "restarts": sum(1 for w in workers if w["rank"] == 0) - 1}


def _replica_figures(records: list[dict], workers: list[dict], kills: list[dict],
                     healed: list[tuple[float, int]]) -> dict:
    """The replica run's samples kept (each step: its groups x the batch), steps dropped and run again, and each
    kill's survivor lost time and rejoin time (see the module's doc)."""
    groups = [int(r.get("replicas", 0)) for r in records]
    retries = [int(r.get("replica_retries", 0)) for r in records]
    gaps = [records[i]["time"] - records[i - 1]["time"] for i in range(1, len(records))]
    gaps.insert(0, float("nan"))
    typical = statistics.median(g for i, g in enumerate(gaps) if i and groups[i] == 2 and not retries[i])
    by_step = {r["step"]: i for i, r in enumerate(records)}
    for k, kill in enumerate(kills):
        t = kill["at"]
        nxt = kills[k + 1]["at"] if k + 1 < len(kills) else float("inf")
        new = next((w for w in workers if w["group"] == 1 and w["started"] > t), None)
        heal = next(((ts, s) for ts, s in healed if t < ts < nxt), None)
        i0 = next((i for i, r in enumerate(records) if r["time"] > t), None)
        # the step the survivor trained with the healed group; none healed: the survivor's last step (the restarted
        # group came back after the survivor had ended, and trains alone from its own last checkpoint)
        ih = by_step.get(heal[1] + 1) if heal else len(records) - 1
        figures: dict[str, Any] = {"restart_s": None, "startup_s": None, "rejoin_s": None, "healed_at_step": None,
                                   "loss_s": None, "alone_s": None, "heal_s": None, "lost_s": None,
                                   "steps_alone": None, "retries": None}
        if new is not None:
            figures["restart_s"] = new["started"] - t
            if heal is not None:
                figures["startup_s"] = heal[0] - new["started"]
            if new["first_step"] is not None:
                figures["rejoin_s"] = new["first_step"] - t
        if heal is not None:
            figures["healed_at_step"] = heal[1]
        if i0 is not None and ih is not None and ih >= i0:
            alone = [i for i in range(i0, ih if heal else ih + 1) if groups[i] == 1]
            ia = alone[0] if alone else ih - 1  # the first step without group 1 (or the step before the heal)
            excess = [gaps[i] - typical for i in range(len(gaps))]
            figures.update({"loss_s": sum(excess[i0:ia + 1]), "alone_s": sum(excess[ia + 1:ih if heal else ih + 1]),
                            "heal_s": excess[ih] if heal else None, "lost_s": sum(excess[i0:ih + 1]),
                            "steps_alone": len(alone), "retries": sum(retries[i0:ih + 1])})
        kill.update(figures)
    before = records[0]["step"] - 1  # trained by group 1 alone, before group 0 joined and healed at the start
    return {"samples_kept": (sum(groups) + before) * BATCH, "steps_alone": groups.count(1) + before,
            "steps_before_group0": before, "retries": sum(retries),
            "typical_step_s": typical, "restarts": len([w for w in workers if w["group"] == 1]) - 1}


MEANS = ("restart_s", "startup_s", "rejoin_s", "loss_s", "alone_s", "heal_s", "lost_s", "start_s", "recover_s")


def run(quick: bool = False, root: str | None = None) -> dict:
    """Both jobs without faults, then with faults: the plain job once, the replica groups once per heartbeat
    timeout. ``faulty``: the runs with faults, each with its ``goodput_of_fault_free`` (steps) and
    ``samples_of_fault_free`` against its own job's fault-free run."""
    p = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(dir=root, prefix="cadence-replica-goodput-") as tmp:
        # each job's fault-free run beside its faulty ones (the shared machine's load drifts): plain, plain with
        # faults; replicas with faults (the last heartbeat timeout), fault-free, with faults (the others)
        *others, last = p["heartbeat_timeouts"]
        clean = {"plain": one_run(Path(tmp, "plain"), p, replicas=False)}
        faulty = [one_run(Path(tmp, "plain-faulty"), p, replicas=False, faults=True)]
        before = one_run(Path(tmp, "replicas-faulty-last"), p, replicas=True, heartbeat_s=last, faults=True)
        clean["replicas"] = one_run(Path(tmp, "replicas"), p, replicas=True)
        faulty += [one_run(Path(tmp, f"replicas-faulty{i}"), p, replicas=True, heartbeat_s=h, faults=True)
                   for i, h in enumerate(others)] + [before]
        plain_identical = _same_weights(clean["plain"]["weights"], faulty[0]["weights"])
        for x in (*clean.values(), *faulty):
            x.pop("weights")
    for f in faulty:
        c = clean[f["job"]]
        f["goodput_of_fault_free"] = f["goodput_steps"] / c["goodput_steps"]
        f["samples_of_fault_free"] = f["goodput_samples"] / c["goodput_samples"]
        f["wall_added_per_kill_s"] = (f["wall_s"] - c["wall_s"]) / len(f["kills"]) if f["kills"] else None
        f["mean"] = {key: _mean([k.get(key) for k in f["kills"]]) for key in MEANS}
        if f["job"] == "plain":  # the others' loss: the recovery, then the steps since the last checkpoint again
            redo = f["lost_steps"] / len(f["kills"]) * f["typical_step_s"] if f["kills"] else 0.0
            f["lost_per_kill_s"] = None if f["mean"]["recover_s"] is None else f["mean"]["recover_s"] + redo
        else:
            f["lost_per_kill_s"] = f["mean"]["lost_s"]
        f["steady_goodput"] = (1 - f["lost_per_kill_s"] / p["kill_every"]
                               if f["lost_per_kill_s"] is not None and "kill_every" in p else None)
    return {"quick": quick, **p, "max_restarts": MAX_RESTARTS, "batch_per_process": BATCH, "clean": clean,
            "faulty": faulty, "plain_faulty_identical_weights": plain_identical, "load_average_1min_end": os.getloadavg()[0],
            "cores": os.cpu_count()}


def fault_text(r: dict) -> str:
    if "kill_after_steps" in r:
        return f"killed once, after {r['kill_after_steps']} steps"
    return f"killed every {r['kill_every']:g} s"


def _name(x: dict, r: dict) -> str:
    if x["job"] == "plain":
        return "plain 2-rank job" + (f", rank 1 {fault_text(r)}" if x["faults"] else ", no faults")
    heartbeat = f", heartbeat_timeout_s {x['heartbeat_timeout_s']:g}" if x["heartbeat_timeout_s"] else ""
    return "2 replica groups" + (f", group 1 {fault_text(r)}{heartbeat}" if x["faults"] else ", no faults")


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## Goodput of replica groups vs. restarts (2 groups of 1 process, torchft over gloo, vs. a 2-rank "
              f"job; CPU; {r['steps']} steps of {r['step_time'] * 1000:.0f} ms, a global batch of "
              f"{2 * r['batch_per_process']}, a checkpoint every {r['checkpoint_interval']} steps; SIGKILL "
              f"{fault_text(r)}, --max-restarts {r['max_restarts']}{', quick' if r.get('quick') else ''})\n"),
             "| run | wall s | first step's end s | after the last step s | kills | steps/s | "
             "goodput of fault-free (steps) | samples/s | goodput of fault-free (samples) | wall added per kill s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in (r["clean"]["plain"], r["faulty"][0], r["clean"]["replicas"], *r["faulty"][1:]):
        lines.append(f"| {_name(x, r)} | {x['wall_s']:.1f} | {_s(x.get('first_step_s'))} | "
                     f"{_s(x['wall_s'] - x['last_step_s'] if 'last_step_s' in x else None)} | "
                     f"{len(x['kills'])} | {x['goodput_steps']:.2f} | "
                     f"{_percent(x.get('goodput_of_fault_free'))} | {x['goodput_samples']:.0f} | "
                     f"{_percent(x.get('samples_of_fault_free'))} | {_s(x.get('wall_added_per_kill_s'))} |")
    lines += ["", "Per failure, mean (each kill):", "",
              "| run | what the others lose, s | the killed one back, s | lost per failure s | "
              "steady state: 1 - lost / kill interval |", "|---|---|---|---|---|"]
    for x in r["faulty"]:
        m = x["mean"]
        if x["job"] == "plain":
            lines.append(f"| {_name(x, r)} | everything: the job restarts from its last checkpoint; "
                         f"{x['lost_steps']} steps run again in all | recovery (kill to the new attempt's first "
                         f"step) {_s(m['recover_s'])} = restart {_s(m['restart_s'])} + start {_s(m['start_s'])} "
                         f"(each: {_each(x, 'recover_s')}) | {_s(x['lost_per_kill_s'])} | "
                         f"{_percent(x['steady_goodput'])} |")
        else:
            lines.append(f"| {_name(x, r)} | survivor's lost time {_s(m['lost_s'])} = loss {_s(m['loss_s'])} + "
                         f"alone {_s(m['alone_s'])} + heal {_s(m['heal_s'])} (each: {_each(x, 'lost_s')}); "
                         f"{x['steps_alone']} steps with 1 group, {x['retries']} run again | rejoin (kill to its "
                         f"healed step's end) {_s(m['rejoin_s'])}: restart {_s(m['restart_s'])}, start-up to the heal "
                         f"{_s(m['startup_s'])} (each: {_each(x, 'rejoin_s')}) | {_s(x['lost_per_kill_s'])} | "
                         f"{_percent(x['steady_goodput'])} |")
    skipped = sum(x["skipped_ticks"] for x in r["faulty"])
    lines.append(f"\nGoodput: steps kept / wall, from the launcher starting to its exit; every run keeps all "
                 f"{r['steps']} steps, so its ratio to the fault-free run is the fault-free wall over its own. "
                 f"First step's end and after the last step: in the wall, from `train/metrics.jsonl` (rank 0's, group "
                 f"0's). The fault-free and faulty runs of a job ran one after the other on a shared machine whose "
                 f"load drifts: the steady state (1 - the time lost per failure / the kill interval, the time lost "
                 f"measured within the faulty run against its own median step) does not compare runs. Lost per "
                 f"failure, plain job: the recovery plus the steps run again (at its median step); replica groups: "
                 f"the survivor's lost time. "
                 f"Samples: a step group 0 trains alone (group 1 away) is kept but trains half the global batch. "
                 f"Survivor's lost time: its steps' time beyond a fault-free two-group step, from the kill to the "
                 f"step at which group 1 healed: loss (the step in flight, dropped and run again after the "
                 f"lighthouse's heartbeat timeout), alone (steps without group 1), heal (serving its state). "
                 f"Rejoin: restart (the launcher starts the group again), start-up (imports, data, the run's last "
                 f"checkpoint, the lighthouse, the quorum, healing), then that step. The plain job's recovery: restart (its "
                 f"agent stops the other rank and starts both again), start (imports, process group, restore, "
                 f"one step); then it runs again the steps since its last checkpoint. Group 1 is the one killed "
                 f"(group 0's chief writes the checkpoints). {skipped} kill tick(s) skipped (the victim not back "
                 f"yet). The plain job's weights with faults are bit-identical to its fault-free run's: "
                 f"{'yes' if r['plain_faulty_identical_weights'] else 'NO'}. Load average (1 min) at the "
                 f"end {r['load_average_1min_end']:.1f} on {r['cores']} cores.\n")
    return lines


def _each(x: dict, key: str) -> str:
    """``key`` of each of the run's kills: ``4.9, 4.7, -``."""
    return ", ".join(_s(k.get(key)) for k in x["kills"]) or "-"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def main() -> None:
    quick_main(__doc__, "goodput of replica groups vs. restarts", "faults/replica_goodput.py", run, markdown_lines)


if __name__ == "__main__":
    main()
