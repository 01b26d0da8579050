"""``trainer.strategy: fsdp`` (FSDP2 sharding) on 2 ranks, gloo on CPU: it trains to the same
weights as DDP, resumes exactly, clips by the global norm, evaluates uneven shards, and rejects
what it does not support."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from cadence.summaries.metrics_file import read_metrics
from cadence.torch.checkpoint_io.sharded import read_model_state
from cli_run import checkpoint_weights, run_cadence, run_torchrun, same_weights
from configs import write_config

WORKER = Path(__file__).parents[1] / "fsdp_worker.py"
cadence = partial(run_cadence, env={"COLUMNS": "200"})  # the CLI runner, 200 columns wide


def weights(model_dir: Path, step: int) -> dict:
    return checkpoint_weights(model_dir / "checkpoints" / f"ckpt-{step}")


def train(config: Path, model_dir: Path, *sets: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    proc = cadence("train", str(config), "--model-dir", str(model_dir), "--nproc", "2", "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("extra, exact", [
    ((), True),
    (("trainer.grad_accum_steps=2", "checkpoint.async_save=true"), True),
    (("trainer.grad_clip_norm=0.05",), False),
], ids=["plain", "accum-async", "clip"])
def test_fsdp_trains_evaluates_and_checkpoints_the_same_weights_as_ddp(tmp_path, extra, exact):
    config = write_config(tmp_path, params={"n": 256})
    train(config, tmp_path / "ddp", *extra)
    train(config, tmp_path / "fsdp", "trainer.strategy=fsdp", *extra)
    if exact:
        # FSDP reduce-scatters the same averaged gradients DDP all-reduces (a sum of 2 on gloo,
        # then / 2; accumulated micro-batches are summed locally first in both) and each rank's
        # optimizer updates its shard elementwise as DDP updates the whole: bit-identical on CPU.
        assert same_weights(weights(tmp_path / "fsdp", 24), weights(tmp_path / "ddp", 24))
    else:
        # Clipping: FSDP's global norm is the sum of the per-shard squared norms, all-reduced; DDP's
        # sums the same squares in another order. The clip coefficient differs in its last bits.
        ddp_w, fsdp_w = weights(tmp_path / "ddp", 24), weights(tmp_path / "fsdp", 24)
        for key, value in ddp_w.items():
            assert torch.allclose(fsdp_w[key], value, rtol=1e-5, atol=1e-6), (key, (fsdp_w[key] - value).abs().max())
    ddp_evals, fsdp_evals = read_metrics(tmp_path / "ddp" / "eval"), read_metrics(tmp_path / "fsdp" / "eval")
    assert [r["step"] for r in fsdp_evals] == [8, 16, 24]
    assert [r["accuracy"] for r in fsdp_evals] == [r["accuracy"] for r in ddp_evals]
    # the checkpoint is sharded (each rank wrote its shards), and assembles into DDP's keys and shapes
    ddp, fsdp = weights(tmp_path / "ddp", 24), weights(tmp_path / "fsdp", 24)
    assert {k: v.shape for k, v in fsdp.items()} == {k: v.shape for k, v in ddp.items()}
    files = sorted(p.name for p in (tmp_path / "fsdp" / "checkpoints" / "ckpt-24").iterdir())
    assert files == [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp", "state.json"]


def test_an_fsdp_run_resumed_from_a_checkpoint_ends_bit_identical(tmp_path):
    """Also with pipelined asynchronous saves whose copy is still in flight at the next optimizer step
    (slowed down): their checkpoints are the synchronous run's, bit for bit."""
    trainer = {"train_steps": 40, "strategy": "fsdp"}
    config = write_config(tmp_path, params={"n": 256}, trainer=trainer)
    pipelined = write_config(tmp_path, "SlowStagingTask", name="pipelined.yaml", params={"n": 256}, trainer=trainer,
                             checkpoint={"async_save": True})
    train(config, tmp_path / "straight")
    run = tmp_path / "run"
    train(pipelined, run, "trainer.train_steps=20")
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == 20
    for step in (8, 16):  # saved while training went on
        for shard in ("__0_0.distcp", "__1_0.distcp"):
            path = f"checkpoints/ckpt-{step}/{shard}"
            assert (run / path).read_bytes() == (tmp_path / "straight" / path).read_bytes(), path
    train(pipelined, run)
    assert same_weights(weights(run, 40), weights(tmp_path / "straight", 40))
    # the optimizer's shards too: every rank's file holds the same bytes as the uninterrupted run's
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        path = f"checkpoints/ckpt-40/{shard}"
        assert (run / path).read_bytes() == (tmp_path / "straight" / path).read_bytes()


def test_fsdp_clips_by_the_global_norm_and_evaluates_uneven_shards(tmp_path):
    proc = run_torchrun(2, str(WORKER), str(tmp_path), env={"COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["sharded"] and res["dtensor_params"]
        assert res["local_numel"] * 2 == res["full_numel"]  # each rank holds half
        # clip_grad_norm_ on the DTensor shards: the norm of the whole gradient, not of a shard
        assert res["fsdp_norm"] == pytest.approx(res["ref_norm"], rel=1e-6)
        assert res["clipped_norm"] == pytest.approx(res["ref_norm"] / 2, rel=1e-5)
        assert res["clipped_grad_max_diff"] < 1e-7
        # rank 0 evaluates 2 batches, rank 1 one: no hang, the unsharded model's metrics
        sharded, plain = res["eval"]
        assert sharded == pytest.approx(plain, rel=1e-6)
        assert res["params_sharded_after_eval"]


def test_fsdp_with_bf16_trains_and_saves_float32_weights(tmp_path):
    config = write_config(tmp_path, params={"n": 256}, trainer={"train_steps": 8, "strategy": "fsdp", "precision": "bf16"})
    train(config, tmp_path / "run")
    weights = checkpoint_weights(tmp_path / "run" / "checkpoints" / "ckpt-8")
    assert {str(v.dtype) for v in weights.values()} == {"torch.float32"}  # bf16 only in the all-gathers
    assert read_metrics(tmp_path / "run" / "eval")[-1]["step"] == 8


@pytest.mark.parametrize("sets, message", [
    (("trainer.strategy=fsdp", "trainer.precision=fp16"), "'fp16' is not supported with trainer.strategy 'fsdp'"),
    (("trainer.strategy=zero3",), "trainer.strategy"),
])
def test_an_unsupported_strategy_setting_is_a_one_line_config_error(tmp_path, sets, message):
    config = write_config(tmp_path, params={"n": 256})
    proc = cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress",
                   *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("on", ["best", "final"])
def test_fsdp_exports_the_gathered_model_equal_to_its_checkpoint(tmp_path, on):
    import yaml

    config = write_config(tmp_path, params={"n": 256}, trainer={"train_steps": 16, "strategy": "fsdp",
                                                                 "best_checkpoint": {"metric": "accuracy"}})
    cfg = yaml.safe_load(config.read_text())
    cfg["export"] = {"on": on, "formats": ["safetensors", "torch_export"]}
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    train(config, run)
    exports = sorted((run / "export" / on).iterdir())
    assert exports, "nothing exported"
    step = int(exports[-1].name)
    exported = checkpoint_weights(exports[-1])  # export/<on>/<step>/model.safetensors
    assert same_weights(exported, weights(run, step))  # the full model, gathered from the shards
    assert (exports[-1] / "model.pt2").exists()


def test_a_weight_tied_gpt_with_an_ema_trains_resumes_and_exports_weights_that_keep_the_tie(tmp_path):
    """Issue 27: the GPT's lm_head is its token embedding; sharded, resumed, consolidated and exported, the
    full weights load with a plain load_state_dict(load_file(...)) and keep the tie (tied_weights_check.py)."""
    from tied_weights_check import HEAD, WTE, check_tied_weights, gpt_config

    config, run = gpt_config(tmp_path, strategy="fsdp"), tmp_path / "run"
    train(config, run, "trainer.train_steps=8")
    train(config, run)  # resumed from the sharded checkpoint at 8
    assert (run / "checkpoints" / "ckpt-16" / "__1_0.distcp").exists()
    for key in ("model", "ema"):  # the consolidated state holds both names, equal
        state = read_model_state(str(run / "checkpoints" / "ckpt-16"), key=key)
        assert torch.equal(state[HEAD], state[WTE]), key
    check_tied_weights(run)
