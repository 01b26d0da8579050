"""The one writer of benchmark results, and what every results page starts with: the machine.

A benchmark run on its own (``--out PATH``) writes the markdown table at ``PATH`` and the
measurements as JSON next to it (``PATH`` with ``.json``); ``run.py`` (``make bench``) writes
``results/latest.*`` the same way. Imports no other benchmark module.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable


def machine() -> dict[str, Any]:
    """The CPU, core count, Python and torch versions, platform and date of this run."""
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def header(m: dict[str, Any], reproduce: str = "make bench") -> list[str]:
    """The first lines of a page of several benchmarks' results: its title, the machine ``m``
    (see :func:`machine`) and the command that reproduces it."""
    return ["# cadence benchmarks\n", (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
                                       f"{m['date']}. Reproduce: `{reproduce}`.\n")]


def write_results(out: str | Path | None, text: str, result: dict[str, Any]) -> None:
    """Write ``text`` (ending in one newline) to ``out`` and ``result`` to ``out`` with ``.json``;
    nothing when ``out`` is None."""
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
    path.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


def run_on_this_machine(title: str, script: str, run: Callable[[], dict[str, Any]],
                        markdown_lines: Callable[[dict[str, Any]], list[str]],
                        results: str | None = None) -> tuple[str, dict[str, Any]]:
    """``run()``, with the machine and its load average (1 min) before and after added to the
    result as ``machine``; the page: ``# title``, the machine line and how to reproduce it (``script``:
    its path under ``benchmarks/``, writing ``results/<results>.md``, by default the script's name), the table."""
    load = os.getloadavg()[0]
    result = run()
    result["machine"] = {**machine(), "load_average_1min": [load, os.getloadavg()[0]]}
    m = result["machine"]
    text = "\n".join([f"# cadence benchmark: {title}\n",
                      (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, {m['date']}; load "
                       f"average (1 min) {load:.1f} at the start, {m['load_average_1min'][1]:.1f} at the end. "
                       f"Reproduce: `OMP_NUM_THREADS=1 python benchmarks/{script} "
                       f"--out benchmarks/results/{results or Path(script).stem}.md`.\n"), *markdown_lines(result)])
    return text, result


def quick_main(doc: str, title: str, script: str, run: Callable[..., dict[str, Any]],
               markdown_lines: Callable[[dict[str, Any]], list[str]]) -> None:
    """The command line of a benchmark that takes ``--quick`` and ``--out`` alone: ``run(quick=...)``
    on this machine (:func:`run_on_this_machine`), its page printed and written (:func:`write_results`).
    ``doc``: the benchmark module's docstring (its first paragraph describes the command)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    text, result = run_on_this_machine(title, script, lambda: run(quick=args.quick), markdown_lines)
    print(text)
    write_results(args.out, text, result)
