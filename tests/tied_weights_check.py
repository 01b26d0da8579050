"""The tied-weights check of tests/processes/test_tied_weights_cli.py and test_fsdp.py: :func:`gpt_config` writes the
config of the weight-tied GPT with an EMA and an export ``on: best``; :func:`check_tied_weights` runs this file.

Run by path in a fresh interpreter, ``python tied_weights_check.py MODEL_DIR STEP`` checks the weight-tied GPT
(``gpt_tasks.TinyGPT``) that a ``cadence train`` with ``trainer.ema`` and an export ``on: best`` left in
MODEL_DIR, at its best checkpoint STEP, and prints one JSON line ``{check: bool}``.

The reference is cadence's own evaluation path: the evaluator built from the model dir's config,
restored from ``checkpoints/ckpt-STEP`` by a ``CheckpointManager``, its EMA applied (what an evaluation and
the export use). Each other way to the weights must give the same logits of a fixed input, bit for bit,
and a model whose ``lm_head.weight`` still *is* its token embedding: a plain
``TinyGPT().load_state_dict(load_file(...))`` of the export and of the checkpoint's ``ema.safetensors``
(or, for a sharded checkpoint, of its consolidated EMA), ``load_exported``, and ``best/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from cadence.checkpoint import CheckpointManager
from cadence.config import load_config
from cadence.torch import load_exported
from cadence.torch.checkpoint_io.sharded import read_model_state
from cadence.torch.components.ema import applied
from cadence.torch.experiments.runners import build_runners_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_tasks import TinyGPT  # noqa: E402

HEAD, WTE = "lm_head.weight", "transformer.wte.weight"
X = torch.arange(32).view(2, 16) % 32
TRAINER = {"train_steps": 16, "checkpoint_interval": 8, "validation_interval": 8, "ema": {"decay": 0.9},
           "best_checkpoint": {"metric": "loss", "higher_is_better": False}}
"""The GPT's trainer section (over tests/configs.py's defaults)."""


def gpt_config(directory: Path, **trainer: Any) -> Path:
    """The GPT's config (``named_splits: false``, an EMA, a safetensors export of each best) in ``directory``."""
    from configs import write_config

    return write_config(directory, "gpt_tasks.py:TinyGPTTask", params={"named_splits": False},
                        trainer={**TRAINER, **trainer}, export={"formats": ["safetensors"], "on": "best"})


def check_tied_weights(run: Path) -> int:
    """Run this file on ``run``'s best checkpoint in a fresh interpreter, assert every check; the step."""
    from cli_run import run_python

    step = json.loads((run / "best" / "best.json").read_text())["step"]
    proc = run_python([__file__, str(run), str(step)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict.fromkeys(result, True) and len(result) == 5, result
    return step


def tied(model: TinyGPT) -> bool:
    return model.lm_head.weight is model.transformer["wte"].weight


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(X)[0]


def cadences(run: Path, directory: Path, step: int) -> torch.Tensor:
    """The logits of cadence's evaluation path for checkpoint ``step`` of ``directory``."""
    cfg = load_config(str(run / "config.yaml"), model_dir=str(run))
    _, _, _, evaluator = build_runners_from_config(cfg, train=False, device="cpu")
    assert CheckpointManager(str(directory), writer=False).restore({"evaluator": evaluator}, step) == step
    assert tied(evaluator.model), "the evaluator's model lost the tie"
    assert evaluator.ema is not None and evaluator.ema.averaged_state()[HEAD] is evaluator.ema.averaged_state()[WTE]
    with applied(evaluator.ema):
        return logits(evaluator.model)


def plain(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a fresh TinyGPT after a plain, strict ``load_state_dict(state)``."""
    model = TinyGPT()
    model.load_state_dict(state)
    assert tied(model), "a plain load_state_dict lost the tie"
    return logits(model)


def main() -> None:
    run, step = Path(sys.argv[1]), int(sys.argv[2])
    checkpoint, export = run / "checkpoints" / f"ckpt-{step}", run / "export" / "best" / str(step)
    reference = cadences(run, run / "checkpoints", step)
    sharded = not (checkpoint / "model.safetensors").exists()
    ema = read_model_state(str(checkpoint), key="ema") if sharded else load_file(checkpoint / "ema.safetensors")
    raw = read_model_state(str(checkpoint)) if sharded else load_file(checkpoint / "model.safetensors")
    result = {
        "export": torch.equal(plain(load_file(export / "model.safetensors")), reference),
        "load_exported": torch.equal(plain(load_exported(str(export), "safetensors")), reference),
        "checkpoint_ema": torch.equal(plain(ema), reference),
        "checkpoint_raw_differs": not torch.equal(plain(raw), reference),  # loads, and is not the EMA
        "best": torch.equal(cadences(run, run / "best", step), reference),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
