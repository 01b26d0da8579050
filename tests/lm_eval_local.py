"""lm-eval-harness on a folder of local tasks alone, the external evaluator of
tests/processes/test_external_evaluators.py: lm-eval's own ``simple_evaluate`` and ``hf`` model, with a
``TaskManager`` of that folder only (``include_defaults=False``). lm-eval's command line indexes every one
of its built-in tasks at each start (about 9 s of CPU here, twice per test); nothing else differs.
Prints ``{"results": {task: {metric: value}}}`` as its last stdout line (the external evaluator's default
result).

    python tests/lm_eval_local.py EXPORT_DIR TASKS_DIR TASK
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    export, tasks, task = argv
    out = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=[task], device="cpu",
                          batch_size=16, task_manager=TaskManager(include_path=tasks, include_defaults=False))
    print(json.dumps({"results": out["results"]}, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
