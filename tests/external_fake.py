"""A stand-in for an external evaluator command (tests/processes/test_external_evaluators.py): run as
``python external_fake.py MODE --step S --checkpoint DIR --out DIR --state DIR``.

It first checks what cadence promised it: ``--checkpoint`` is a committed checkpoint still on disk
(its ``MANIFEST.json``; exit 9 otherwise), ``--expect-file`` a file (an export's; exit 7) and ``--out`` an
empty directory (exit 8), then counts its
run for the step in ``STATE/<MODE>-<step>`` (a file of one line per run) and, by ``MODE``:

- ``score``: prints a log line, then ``{"results": {"t": {"acc,none": A, "alias": "t"}}, "n": N}``
  with ``A = 1 - |step - 4| / 10`` (best at step 4) and ``N`` its runs for the step;
- ``file``: writes that JSON to ``OUT/sub/results_<step>.json`` instead (nothing on stdout);
- ``flaky``: its first run for a step exits 3 (``flaky: first run fails`` on stderr), later ones print
  ``{"ok": 1}``;
- ``broken``: at step ``--bad-step``, exits 5 (``broken: no luck at step S``); else prints ``{"ok": 1}``;
- ``slow``: at step ``--bad-step``, starts a child ``sleep`` (its pid in ``STATE/slow-child``) and
  sleeps 600 s; else prints ``{"ok": 1}``;
- ``hang-once``: its first run for ``--bad-step`` writes its pid to ``STATE/hang-started`` and sleeps
  600 s (the test kills the sidecar meanwhile); every other run prints ``{"ok": RUNS}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--checkpoint", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--bad-step", type=int, default=-1)
    p.add_argument("--expect-file", default="")
    a = p.parse_args()
    if a.checkpoint and not Path(a.checkpoint, "MANIFEST.json").is_file():
        print(f"no committed checkpoint at {a.checkpoint}", file=sys.stderr)
        return 9
    if a.expect_file and not Path(a.expect_file).is_file():
        print(f"no file {a.expect_file}", file=sys.stderr)
        return 7
    if not Path(a.out).is_dir() or any(Path(a.out).iterdir()):
        print(f"{a.out} is not a fresh empty directory", file=sys.stderr)
        return 8
    count = Path(a.state, f"{a.mode}-{a.step}")
    with count.open("a") as f:
        f.write("run\n")
    runs = len(count.read_text().splitlines())
    result = {"results": {"t": {"acc,none": 1 - abs(a.step - 4) / 10, "alias": "t"}}, "n": runs}
    if a.mode == "score":
        print("a log line, then the result")
        print(json.dumps(result))
    elif a.mode == "file":
        Path(a.out, "sub").mkdir()
        Path(a.out, "sub", f"results_{a.step}.json").write_text(json.dumps(result, indent=2))
    elif a.mode == "flaky" and runs == 1:
        print("flaky: first run fails", file=sys.stderr)
        return 3
    elif a.mode == "broken" and a.step == a.bad_step:
        print(f"broken: no luck at step {a.step}", file=sys.stderr)
        return 5
    elif a.mode == "slow" and a.step == a.bad_step:
        child = subprocess.Popen(["sleep", "600"])
        Path(a.state, "slow-child").write_text(str(child.pid))
        print("slow: sleeping", flush=True)
        time.sleep(600)
    elif a.mode == "hang-once" and a.step == a.bad_step and runs == 1:
        Path(a.state, "hang-started").write_text(str(os.getpid()))
        time.sleep(600)
    else:
        print(json.dumps({"ok": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
