"""Writing a benchmark's results when it runs on its own (``--out PATH``): the markdown table at
``PATH`` and the measurements as JSON next to it (``PATH`` with ``.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def write_results(out: str | None, text: str, result: dict[str, Any]) -> None:
    """Write ``text`` (ending in one newline) to ``out`` and ``result`` to ``out`` with ``.json``;
    nothing when ``out`` is None."""
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
    path.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


def run_on_this_machine(title: str, script: str, run: Callable[[], dict[str, Any]],
                        markdown_lines: Callable[[dict[str, Any]], list[str]]) -> tuple[str, dict[str, Any]]:
    """``run()``, with the machine and its load average (1 min) before and after added to the
    result as ``machine``; the page: ``# title``, the machine line and how to reproduce it, the table."""
    from run import machine

    load = os.getloadavg()[0]
    result = run()
    result["machine"] = {**machine(), "load_average_1min": [load, os.getloadavg()[0]]}
    m = result["machine"]
    text = "\n".join([f"# cadence benchmark: {title}\n",
                      (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, {m['date']}; load "
                       f"average (1 min) {load:.1f} at the start, {m['load_average_1min'][1]:.1f} at the end. "
                       f"Reproduce: `OMP_NUM_THREADS=1 python benchmarks/{script} "
                       f"--out benchmarks/results/{Path(script).stem}.md`.\n"), *markdown_lines(result)])
    return text, result
