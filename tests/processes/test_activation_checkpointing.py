"""``trainer.activation_checkpointing``: the chosen units (every N-th one ``fsdp_units`` names)
recompute their activations in backward, dropout included, and nothing else changes: the same
weights bit for bit on CPU, the same checkpoint keys, and checkpoints that resume either way; on one
process and on two ranks under FSDP2 and DDP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from cadence.config import load_config
from cadence.config.schema import TrainerConfig
from cadence.errors import ConfigError
from cadence.torch import run_training
from cadence.torch.components.compile import compile_model, eager_forward
from cadence.config.components.compile import CompileConfig
from cadence.config.schema import ActivationCheckpointConfig
from cadence.torch.parallel.activation_checkpoint import apply_activation_checkpointing, chosen_units, is_checkpointed
from cli_run import checkpoint_weights, run_cadence, same_weights

sys.path.insert(0, str(Path(__file__).parents[1]))
from ac_tasks import BlockModel, BlockTask  # noqa: E402

HERE = Path(__file__).parents[1]
BLOCKS = f"{HERE / 'ac_tasks.py'}:BlockTask"
NO_UNITS = f"{HERE / 'ac_tasks.py'}:NoUnitsTask"


def write_config(path: Path, *, task: str = BLOCKS, **trainer) -> Path:
    cfg = {"task": {"class": task, "params": {"n": 128}},
           "trainer": {"train_steps": 8, "steps_per_loop": 4, "checkpoint_interval": 4, "validation_interval": None,
                       "max_to_keep": None, "seed": 1, **trainer}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_here(config: Path, model_dir: Path, *overrides: str) -> None:
    run_training(load_config(config, list(overrides), model_dir=str(model_dir)), progress=False)


def weights(model_dir: Path, step: int) -> dict:
    return checkpoint_weights(model_dir / "checkpoints" / f"ckpt-{step}")


def test_the_setting_takes_none_full_or_every_n():
    assert TrainerConfig().activation_checkpointing is None
    assert TrainerConfig(activation_checkpointing="none").activation_checkpointing is None
    assert TrainerConfig(activation_checkpointing=False).activation_checkpointing is None
    assert TrainerConfig(activation_checkpointing="full").activation_checkpointing == ActivationCheckpointConfig(every=1)
    assert TrainerConfig(activation_checkpointing=True).activation_checkpointing.every == 1
    assert TrainerConfig(activation_checkpointing={"every": 3}).activation_checkpointing.every == 3


@pytest.mark.parametrize("override, message", [
    ("trainer.activation_checkpointing={every: 0}", "trainer.activation_checkpointing.every"),
    ("trainer.activation_checkpointing={every: two}", "trainer.activation_checkpointing.every"),
    ("trainer.activation_checkpointing=sometimes", "trainer.activation_checkpointing: expected none, full"),
    ("trainer.activation_checkpointing={evry: 2}", "trainer.activation_checkpointing.evry: unknown field"),
])
def test_a_bad_setting_is_a_one_line_config_error(tmp_path, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp_path / "config.yaml"), [override])
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_the_checkpointed_units_are_exactly_every_nth_innermost_unit():
    model = BlockModel(depth=5)
    blocks = list(model.blocks)
    units = [model.blocks, *reversed(blocks)]  # a container and its blocks, in any order: the blocks count
    assert chosen_units(model, units, 1) == blocks
    assert chosen_units(model, units, 2) == [blocks[1], blocks[3]]
    assert chosen_units(model, units, 3) == [blocks[2]]
    assert chosen_units(model, units, 6) == []
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, units, 2)
    assert [is_checkpointed(b) for b in blocks] == [False, True, False, True, False]
    assert not is_checkpointed(model) and not is_checkpointed(model.blocks)
    assert list(model.state_dict()) == keys  # no wrapper in any key
    with pytest.raises(ConfigError, match="names no unit of BlockModel"):
        apply_activation_checkpointing(BlockModel(), [], 1)


def gradients(every: int | None, compiled: bool = False) -> tuple[dict, int]:
    """One backward of BlockModel with dropout; the gradients and how many times block 1's linear ran."""
    torch.manual_seed(0)
    model = BlockModel()
    if every is not None:
        apply_activation_checkpointing(model, list(model.blocks), every)
    if compiled:
        compile_model(BlockTask(), model, CompileConfig(backend="aot_eager"), per_unit=True)
    calls = []
    model.blocks[1].linear.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(5)
    model(torch.randn(32, 8)).square().sum().backward()
    return {k: p.grad for k, p in model.named_parameters()}, len(calls)


def test_a_checkpointed_unit_runs_again_in_backward_with_the_same_dropout_mask():
    plain, ran = gradients(None)
    assert ran == 1
    for every, again in ((1, 2), (2, 2), (3, 1)):  # block 1 is checkpointed when every is 1 or 2
        grads, ran = gradients(every)
        assert ran == again, every
        assert all(torch.equal(grads[k], plain[k]) for k in plain), every
    torch._dynamo.reset()
    grads, _ = gradients(1, compiled=True)  # each unit compiled with its checkpoint inside
    assert all(torch.equal(grads[k], plain[k]) for k in plain)
    torch._dynamo.reset()


def test_exports_trace_the_units_own_forward():
    model = BlockModel()
    apply_activation_checkpointing(model, list(model.blocks), 1)
    with eager_forward(model):
        assert not any(is_checkpointed(b) for b in model.blocks)
    assert all(is_checkpointed(b) for b in model.blocks)


def test_on_one_process_none_full_and_every_2_train_the_same_weights_and_resume_each_other(tmp_path, caplog):
    config = write_config(tmp_path / "config.yaml")
    runs = {name: tmp_path / name for name in ("none", "full", "every2")}
    caplog.set_level("INFO", logger="cadence.torch.parallel.activation_checkpoint")
    train_here(config, runs["none"])
    assert "activation checkpointing" not in caplog.text
    train_here(config, runs["full"], "trainer.activation_checkpointing=full")
    assert "activation checkpointing: 4 unit(s) of BlockModel (DropoutBlock), every 1" in caplog.text
    train_here(config, runs["every2"], "trainer.activation_checkpointing={every: 2}")
    assert "activation checkpointing: 2 unit(s) of BlockModel (DropoutBlock), every 2" in caplog.text
    reference = weights(runs["none"], 8)
    assert any(k.startswith("blocks.3.") for k in reference) and not [k for k in reference if "wrapped" in k]
    for name in ("full", "every2"):
        for step in (4, 8):
            assert same_weights(weights(runs[name], step), weights(runs["none"], step)), (name, step)
    # A checkpoint with it resumes without it, and one without it resumes with it: the same end.
    with_ac, without = tmp_path / "with", tmp_path / "without"
    train_here(config, with_ac, "trainer.train_steps=4", "trainer.activation_checkpointing=full")
    train_here(config, with_ac)
    train_here(config, without, "trainer.train_steps=4")
    train_here(config, without, "trainer.activation_checkpointing={every: 2}")
    assert same_weights(weights(with_ac, 8), reference)
    assert same_weights(weights(without, 8), reference)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_on_two_ranks_every_2_trains_the_same_weights_and_keys(tmp_path, strategy):
    config = write_config(tmp_path / "config.yaml", strategy=strategy, train_steps=4)
    plain, checkpointed = tmp_path / "plain", tmp_path / "ac"
    for run, extra in ((plain, []), (checkpointed, ["--set", "trainer.activation_checkpointing={every: 2}"])):
        proc = run_cadence("train", str(config), "--model-dir", str(run), "--no-progress", "--nproc", "2", *extra,
                           timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        applied = "activation checkpointing: 2 unit(s) of BlockModel (DropoutBlock), every 2" in proc.stderr
        assert applied == bool(extra), proc.stderr[-3000:]
    a, b = plain / "checkpoints" / "ckpt-4", checkpointed / "checkpoints" / "ckpt-4"
    assert sorted(checkpoint_weights(a)) == sorted(checkpoint_weights(b)) == sorted(BlockModel().state_dict())
    assert same_weights(checkpoint_weights(a), checkpoint_weights(b))
    if strategy == "fsdp":  # every rank's shards (model and optimizer), bit for bit
        for shard in ("__0_0.distcp", "__1_0.distcp"):
            assert (a / shard).read_bytes() == (b / shard).read_bytes()


def test_a_task_that_names_no_units_stops_with_one_line_and_exit_2(tmp_path):
    config = write_config(tmp_path / "config.yaml", task=NO_UNITS, activation_checkpointing="full")
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "cadence: error" in line]
    assert errors == ["cadence: error: trainer.activation_checkpointing: NoUnitsTask.fsdp_units names no unit of "
                      "BlockModel to checkpoint: name its blocks there, or set trainer.activation_checkpointing: none"]
    assert "Traceback" not in proc.stderr


def test_a_transformers_models_blocks_are_checkpointed_with_the_same_gradients():
    """GPT-2's ``GPT2Block`` (its ``_no_split_modules``: the default units), dropout on, called with
    keyword arguments and returning tuples."""
    transformers = pytest.importorskip("transformers")
    from cadence.torch.parallel.sharding import default_fsdp_units

    def grads(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config).train()
        if checkpointed:
            chosen = apply_activation_checkpointing(model, default_fsdp_units(model, ()), 1)
            assert [type(u).__name__ for u in chosen] == ["GPT2Block", "GPT2Block"]
        ids = torch.randint(0, 50, (2, 8))
        torch.manual_seed(3)
        model(ids, labels=ids).loss.backward()
        return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and all(torch.equal(plain[k], checkpointed[k]) for k in plain)
