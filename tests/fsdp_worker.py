"""Rank worker of tests/processes/test_fsdp.py::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp_worker.py OUT_DIR

Checks, on every rank, what FSDP2 sharding (``strategy="fsdp"``) does to gradient clipping and to
an evaluation whose ranks run different numbers of batches; writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask, synthetic  # noqa: E402

from cadence.torch import Context, TorchEvaluator  # noqa: E402
from cadence.torch.runtime.distributed import shutdown_distributed  # noqa: E402
from cadence.torch.parallel.sharding import is_sharded, shard_model  # noqa: E402


class UnevenEvalTask(TinyTask):
    """17 validation samples in batches of 8: rank 0 evaluates 2 batches, rank 1 one."""

    def build_inputs(self, split, ctx):
        if split == "train":
            return super().build_inputs(split, ctx)
        return DataLoader(ctx.wrap_dataset(synthetic(17, seed=5)), batch_size=8)

    def validation_step(self, model, batch):
        x, y = batch
        return {"loss": F.cross_entropy(model(x), y)}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(out: Path) -> None:
    ctx = Context.create(device="cpu", seed=0)
    task = UnevenEvalTask()
    torch.manual_seed(0)
    ref = task.build_model()
    model = shard_model(model := copy.deepcopy(ref), task.fsdp_units(model), ctx, "32")
    res: dict = {"sharded": is_sharded(model),
                 "dtensor_params": all(isinstance(p, DTensor) for p in model.parameters()),
                 "local_numel": sum(p.to_local().numel() for p in model.parameters()),
                 "full_numel": sum(p.numel() for p in ref.parameters())}

    # Clipping: the same batch on every rank, so the averaged gradient is the single-process one.
    x, y = synthetic(32, seed=9).tensors
    ref.eval()
    model.eval()  # no dropout: both compute the same function
    F.cross_entropy(ref(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    ref_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.parameters()])).item()
    max_norm = ref_norm / 2
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    res["ref_norm"] = ref_norm
    res["fsdp_norm"] = float(full(norm))
    res["clipped_grad_max_diff"] = max(
        (full(p.grad) - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
    )
    res["clipped_norm"] = torch.linalg.vector_norm(
        torch.cat([full(p.grad).flatten() for p in model.parameters()])).item()

    # Evaluation with a different number of batches per rank: the same metrics as unsharded.
    sharded_eval = TorchEvaluator(task, model, ctx=ctx).evaluate()
    plain_eval = TorchEvaluator(task, ref, ctx=ctx).evaluate()
    res["eval"] = [sharded_eval, plain_eval]
    res["params_sharded_after_eval"] = all(isinstance(p, DTensor) for p in model.parameters())
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(res))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
