"""Rank worker of tests/processes/test_torch_ema.py::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ema_fsdp_worker.py OUT_DIR

An EMA (``cadence.torch.components.ema.ModelEMA``) of a model sharded by FSDP2 and one of the same model
unsharded, trained side by side on the same batches (the same on every rank, so the averaged
gradient is the unsharded one): writes ``OUT_DIR/rank<r>.json`` with what each rank's EMA holds
(DTensors placed as the parameters), how far the two EMAs are apart, what an evaluation of each
reports, and whether ``applied()`` gave the raw weights back.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TinyTask, synthetic  # noqa: E402

from cadence.torch import Context, TorchEvaluator  # noqa: E402
from cadence.torch.runtime.distributed import shutdown_distributed  # noqa: E402
from cadence.config.components.ema import EMAConfig  # noqa: E402
from cadence.torch.components.ema import ModelEMA  # noqa: E402
from cadence.torch.parallel.sharding import shard_model  # noqa: E402


class BatchNormTask(TinyTask):
    """An 8-16-2 MLP with a BatchNorm (float buffers to average, an integer one to keep), no dropout."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(out: Path) -> None:
    ctx = Context.create(device="cpu", seed=0)
    task = BatchNormTask()
    torch.manual_seed(0)
    ref = task.build_model()
    model = shard_model(model := copy.deepcopy(ref), task.fsdp_units(model), ctx, "32")
    ema = ModelEMA(model, EMAConfig(decay=0.75))
    ref_ema = ModelEMA(ref, EMAConfig(decay=0.75))
    params = dict(model.named_parameters())
    state = ema.averaged_state()
    res: dict = {
        "params_are_dtensors": all(isinstance(p, DTensor) for p in params.values()),
        "ema_keys": sorted(state),
        "placed_as_params": all(
            isinstance(state[name], DTensor) and state[name].placements == p.placements
            and state[name].device_mesh == p.device_mesh and state[name].to_local().shape == p.to_local().shape
            for name, p in params.items()),
        "local_numel": sum(state[name].to_local().numel() for name in params),
        "full_numel": sum(p.numel() for p in ref.parameters()),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = synthetic(32, seed=9).tensors
    for step in range(1, 4):
        for m, o, e in ((model, opt, ema), (ref, ref_opt, ref_ema)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            e.on_train_step_end(None, step)  # no run: the EMA needs none
    ref_state = ref_ema.averaged_state()
    res["ema_max_diff"] = max((full(state[k]).float() - ref_state[k].float()).abs().max().item() for k in ref_state)
    res["ema_differs_from_weights"] = any(
        not torch.equal(full(state[name]), full(p.detach())) for name, p in params.items())
    before = {name: full(p.detach()).clone() for name, p in params.items()}
    averaged = {name: full(t).clone() for name, t in state.items()}
    with ema.applied():
        res["applied_is_ema"] = all(torch.equal(full(p.detach()), averaged[name]) for name, p in params.items())
    res["raw_back"] = all(torch.equal(full(p.detach()), before[name]) for name, p in params.items())
    res["ema_back"] = all(torch.equal(full(t), averaged[name]) for name, t in state.items())
    res["eval"] = [TorchEvaluator(task, model, ctx=ctx, ema=ema).evaluate(),
                   TorchEvaluator(task, ref, ctx=ctx, ema=ref_ema).evaluate()]
    res["raw_back_after_eval"] = all(torch.equal(full(p.detach()), before[name]) for name, p in params.items())
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(res))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
