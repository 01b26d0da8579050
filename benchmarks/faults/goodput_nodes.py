"""Goodput under node loss: a two-node job (two ``cadence train --nnodes 2 --nproc 1`` agents on 127.0.0.1, one
rank each, ``--max-restarts K``) whose node 1 is lost every N seconds -- SIGKILL to its agent's whole process group
and to its worker, as a machine dies -- and started again at once, as a scheduler would; next to the same job
without faults.

    OMP_NUM_THREADS=1 python benchmarks/faults/goodput_nodes.py [--quick] [--out benchmarks/results/goodput_nodes.md]

(``benchmarks/results/goodput.md`` shows its table under ``goodput.py``'s.) The run with node losses runs once with
torch's rendezvous keep-alive and once with a short one (``--rdzv-conf``, :data:`SHORT_KEEP_ALIVE`).

Goodput is ``goodput.py``'s: the time of the training loops the final model kept (``train/metrics.jsonl``) / wall
time, from node 0 starting to both nodes' exit. Time to recover: from the kill to the end of the first train step
after it, split into *stop* (the kill to node 0's worker ending: its collective fails and its agent stops it),
*rendezvous* (to both new workers' processes starting: node 0's agent and node 1's new one meet in a new
rendezvous round) and *start* (to the first step's end: imports, process group, restore, one step). Node 0 hosts
the rendezvous store (losing it ends the job), so node 1 is the one lost. A kill tick that finds the job still
recovering from the previous kill (or finished) is skipped. Both runs must end with bit-identical weights (checked).
``benchmarks/run.py`` runs it as ``goodput_nodes``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.faults.goodput import _config, _kept_step_seconds, _same_weights  # noqa: E402
from benchmarks.common.results_file import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASK = f"{HERE / 'goodput_task.py'}:NodeGoodputTask"

SHORT_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=4"
"""``--rdzv-conf`` of a rendezvous that drops a lost node's agent after 4 s instead of torch's 15 s (5 s x 3); with
1 s x 2 here, an agent slowed down by the loaded machine was once taken for lost before the first round ended."""
FULL: dict[str, Any] = {"steps": 600, "step_time": 0.05, "steps_per_loop": 10, "checkpoint_interval": 50, "kill_every": 30.0,
        "rdzv_confs": [None, SHORT_KEEP_ALIVE]}
QUICK: dict[str, Any] = {"steps": 40, "step_time": 0.02, "steps_per_loop": 5, "checkpoint_interval": 10, "kill_after_steps": 15,
         "max_kills": 1, "rdzv_confs": [SHORT_KEEP_ALIVE]}
"""The smoke test's run: node 1 is lost once, when rank 0 has run ``kill_after_steps`` steps, with the short
keep-alive. ``rdzv_confs``: a run with node losses for each (None: torch's default); the run without faults
uses the first."""
MAX_RESTARTS = 100
TORCHFT = ("torchft (as quoted in issue 28): 82.3% of steps committed with a failure every 60 s; a different "
           "measure (steps committed, not time), a different recovery (the survivors go on without the lost "
           "replica group; no restart from a checkpoint) and a GPU cluster")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_node(node: int, cfg: Path, model_dir: Path, port: int, rdzv_conf: str | None, out: IO[Any],
                env: dict[str, str]) -> subprocess.Popen:
    """Node ``node``'s agent (``cadence train``, torch's agent in its process group), in a session of its own."""
    return subprocess.Popen([sys.executable, "-m", "cadence", "train", str(cfg), "--model-dir", str(model_dir),
                             "--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                             f"127.0.0.1:{port}", *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []),
                             "--no-progress", "--max-restarts", str(MAX_RESTARTS)],
                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _workers(attempts: Path) -> list[dict]:
    """Every worker that has built its data so far (``NodeGoodputTask``'s files), oldest first, each with
    ``steps`` and ``first_step`` (None before its first step ended)."""
    found = []
    for path in attempts.glob("worker-*.json"):
        w = json.loads(path.read_text())
        name = path.name[len("worker-"):-len(".json")]
        try:
            w["steps"] = int((attempts / f"steps-{name}").read_text().strip() or 0)
        except (OSError, ValueError):
            w["steps"] = 0
        first = attempts / f"first-{name}"
        w["first_step"] = float(first.read_text()) if first.exists() else None
        found.append(w)
    return sorted(found, key=lambda w: w["started"])


def _newest(workers: list[dict], node: int) -> dict | None:
    mine = [w for w in workers if w["node"] == node]
    return mine[-1] if mine else None


def _recovered_since(workers: list[dict], t: float) -> bool:
    return any(w["started"] > t and w["first_step"] is not None for w in workers)


def _recovery(kill: dict, workers: list[dict]) -> dict:
    """The phases of one kill's recovery (seconds): the first worker of each node started after the kill that
    trained a step; None where the job never trained again."""
    firsts = [w for w in (next((w for w in workers if w["node"] == n and w["started"] > kill["at"] and w["first_step"]),
                               None) for n in (0, 1)) if w is not None]
    if len(firsts) < 2 or kill["stopped"] is None:
        return {"stop_s": None, "rendezvous_s": None, "start_s": None, "recover_s": None}
    up = max(w["started"] for w in firsts)
    first = min(w["first_step"] for w in firsts)
    return {"stop_s": kill["stopped"] - kill["at"], "rendezvous_s": up - kill["stopped"], "start_s": first - up,
            "recover_s": first - kill["at"]}


def one_run(work: Path, p: dict, rdzv_conf: str | None = None, *, faults: bool = False) -> dict:
    """One two-node job to the end (``--rdzv-conf rdzv_conf``); with ``faults``, node 1 lost every ``kill_every`` s
    (or, with ``kill_after_steps``, once rank 0 has run that many steps, ``max_kills`` times) and started again."""
    work.mkdir(parents=True)
    attempts = work / "attempts"
    attempts.mkdir()
    model_dir = work / "run"
    cfg = _config(work / "config.yaml", attempts, p, TASK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    port = _free_port()
    kills: list[dict] = []
    skipped = 0
    logs = [work / "node0.txt", work / "node1-0.txt"]
    start = time.monotonic()
    t0 = time.time()
    procs: dict[int, subprocess.Popen] = {}
    watching: list[tuple[dict, int]] = []  # (kill, node 0's worker then) until that worker has ended
    try:
        with open(logs[0], "w") as out:
            procs[0] = _start_node(0, cfg, model_dir, port, rdzv_conf, out, env)
        while not _listening(port):  # node 0 hosts the rendezvous store
            if procs[0].poll() is not None:
                raise RuntimeError(f"node 0 ended (status {procs[0].returncode}):\n{logs[0].read_text()[-4000:]}")
            time.sleep(0.02)
        with open(logs[1], "w") as out:
            procs[1] = _start_node(1, cfg, model_dir, port, rdzv_conf, out, env)
        tick = start + p["kill_every"] if faults and "kill_every" in p else None
        while procs[0].poll() is None or procs[1].poll() is None:
            now = time.monotonic()
            for kill, pid in list(watching):
                if not _alive(pid):
                    kill["stopped"] = time.time()
                    watching.remove((kill, pid))
            due, workers = False, []
            if faults and "kill_after_steps" in p and len(kills) < p["max_kills"]:
                workers = _workers(attempts)
                due = any(w["rank"] == 0 and w["steps"] >= p["kill_after_steps"] and
                          (not kills or w["started"] > kills[-1]["at"]) for w in workers)
            if tick is not None and now >= tick:
                tick += p["kill_every"]
                workers = _workers(attempts)
                due = _recovered_since(workers, kills[-1]["at"] if kills else 0.0)
                skipped += not due
            if due and procs[1].poll() is None and not (model_dir / "checkpoints" / "FINAL").exists():
                # (a node lost once the job has ended: its new agent finds the rendezvous closed and fails)
                node0, node1 = _newest(workers, 0), _newest(workers, 1)
                if node1 is not None:
                    os.kill(node1["pid"], signal.SIGKILL)  # its worker, in a session of its own
                os.killpg(procs[1].pid, signal.SIGKILL)  # cadence train and torch's agent
                procs[1].wait()
                kill = {"t_s": round(now - start, 2), "at": time.time(), "stopped": None}
                kills.append(kill)
                if node0 is not None:
                    watching.append((kill, node0["pid"]))
                logs.append(work / f"node1-{len(kills)}.txt")
                with open(logs[-1], "w") as out:
                    procs[1] = _start_node(1, cfg, model_dir, port, rdzv_conf, out, env)  # as a scheduler would
            elif procs[0].poll() not in (None, 0) or procs[1].poll() not in (None, 0):
                break
            time.sleep(0.02)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - start
    if any(proc.returncode != 0 for proc in procs.values()):
        tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)
        raise RuntimeError(f"the run in {work} failed ({[p.returncode for p in procs.values()]}):\n{tails}")
    kept_s, kept_steps = _kept_step_seconds(model_dir)
    workers = _workers(attempts)
    steps_run = sum(w["steps"] for w in workers if w["rank"] == 0)
    step_s = kept_s / kept_steps
    lost_steps = steps_run - kept_steps
    recoveries = [{"t_s": k["t_s"], **_recovery(k, workers)} for k in kills]
    return {"rdzv_conf": rdzv_conf, "wall_s": wall, "kills": recoveries, "skipped_ticks": skipped, "attempts": len(workers) // 2,
            "started_at": t0, "steps_run": steps_run, "steps_kept": kept_steps, "lost_steps": lost_steps,
            "kept_step_s": kept_s, "lost_step_s": lost_steps * step_s,
            "other_s": wall - kept_s - lost_steps * step_s, "goodput": kept_s / wall,
            "weights": str(model_dir / "checkpoints" / f"ckpt-{kept_steps}" / "model.safetensors")}


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def run(quick: bool = False, root: str | None = None) -> dict:
    """The two-node job without faults, then with node 1 lost (:func:`fault_text`), once per ``rdzv_confs``."""
    p = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(dir=root, prefix="cadence-goodput-nodes-") as tmp:
        clean = one_run(Path(tmp, "clean"), p, p["rdzv_confs"][0])
        faulty = [one_run(Path(tmp, f"faulty{i}"), p, conf, faults=True) for i, conf in enumerate(p["rdzv_confs"])]
        identical = all(_same_weights(clean["weights"], f.pop("weights")) for f in faulty)
        clean.pop("weights")
    if not identical:
        raise RuntimeError("a run with node losses did not end with the weights of the run without")
    for f in faulty:
        f["goodput_ratio"] = f["goodput"] / clean["goodput"]
        f["mean_recovery"] = {key: _mean([k[key] for k in f["kills"]])
                              for key in ("stop_s", "rendezvous_s", "start_s", "recover_s")}
    return {"quick": quick, **p, "nodes": 2, "ranks": 2, "max_restarts": MAX_RESTARTS, "identical_weights": identical,
            "clean": clean, "faulty": faulty, "load_average_1min": os.getloadavg()[0], "cores": os.cpu_count()}


def fault_text(r: dict) -> str:
    """When node 1 is lost: ``node 1 lost every 25 s``."""
    if "kill_after_steps" in r:
        return f"node 1 lost after {r['kill_after_steps']} steps, {r['max_kills']} time(s)"
    return f"node 1 lost every {r['kill_every']:g} s"


def _keep_alive(conf: str | None) -> str:
    """The keep-alive of ``--rdzv-conf conf``: ``keep-alive 5 s x 3``."""
    settings = dict(item.split("=", 1) for item in conf.split(",")) if conf else {}
    return (f"keep-alive {settings.get('keep_alive_interval', '5')} s x {settings.get('keep_alive_max_attempt', '3')}"
            + ("" if conf else " (torch's default)"))


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown_lines(r: dict) -> list[str]:
    lines = [(f"## Goodput under node loss (2 nodes on 127.0.0.1, 1 rank each, gloo, CPU; {r['steps']} steps of "
              f"{r['step_time'] * 1000:.0f} ms, a checkpoint every {r['checkpoint_interval']} steps; {fault_text(r)} "
              f"(SIGKILL to its agent's process group and its worker, then its agent started again), "
              f"--max-restarts {r['max_restarts']}{', quick' if r.get('quick') else ''})\n"),
             "| run | wall s | node losses | steps run | lost steps | kept-step time s | lost-step time s | other s | "
             "goodput | time to recover s, mean (stop + rendezvous + start) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    runs = [("no faults", r["clean"]), *((f"{fault_text(r)}, {_keep_alive(f['rdzv_conf'])}", f) for f in r["faulty"])]
    for name, x in runs:
        m = x.get("mean_recovery")
        recover = f"{_s(m['recover_s'])} ({_s(m['stop_s'])} + {_s(m['rendezvous_s'])} + {_s(m['start_s'])})" \
            if m and x["kills"] else "-"
        lines.append(f"| {name} | {x['wall_s']:.1f} | {len(x['kills'])} | {x['steps_run']} | {x['lost_steps']} | "
                     f"{x['kept_step_s']:.1f} | {x['lost_step_s']:.1f} | {x['other_s']:.1f} | "
                     f"{x['goodput'] * 100:.1f}% | {recover} |")
    lines.append("")
    for f in r["faulty"]:
        each = "; ".join(f"at {k['t_s']:.0f} s: {_s(k['recover_s'])} ({_s(k['stop_s'])} + {_s(k['rendezvous_s'])} + "
                         f"{_s(k['start_s'])})" for k in f["kills"])
        lines.append(f"- {_keep_alive(f['rdzv_conf'])}: {f['goodput_ratio'] * 100:.1f}% of the fault-free goodput; "
                     f"each loss, time to recover s (stop + rendezvous + start): {each or 'none'}; "
                     f"{f['skipped_ticks']} kill tick(s) skipped while the job was still recovering.")
    lines.append(f"\nTime to recover: from the kill to the end of the first train step after it. Stop: until node 0's "
                 f"worker has ended (its collective fails, then it waits up to 5 s for its agent to stop it, which that "
                 f"agent does once node 1's new agent waits at the rendezvous). Rendezvous: until both new workers' processes "
                 f"have started (node 0's agent and node 1's new one meet in a new round of torch's c10d rendezvous, "
                 f"which first drops the lost agent once its keep-alive has lapsed: interval x attempts, "
                 f"`--rdzv-conf keep_alive_interval=I,keep_alive_max_attempt=N`). Start: imports, process group, "
                 f"restore and that step. Goodput, lost steps and other as in the table above. Final weights "
                 f"bit-identical to the run without faults: {'yes' if r['identical_weights'] else 'NO'}. "
                 f"The machine was shared and loaded (its 1-minute load average {r['load_average_1min']:.1f} at the end, "
                 f"on {r.get('cores', '?')} cores): three Python processes per node (cadence train, torch's agent, the worker) "
                 f"start before a step, so the "
                 f"starts (the fault-free run's other time included) take far longer than on an idle machine. "
                 f"For comparison, {TORCHFT}.\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    result = run(quick=args.quick)
    print(json.dumps(result, indent=1))
    text = "\n".join(markdown_lines(result))
    print(text)
    write_results(args.out, text, result)


if __name__ == "__main__":
    main()
