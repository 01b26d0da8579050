"""Hugging Face models (issue 30, items 1-3), in process, with the tiny GPT-2 of tests/hf_tasks.py: the
``hf`` export loads with ``from_pretrained`` offline, gives the model's logits, keeps the tie, carries the
tokenizer and generates; a sharded export has its index; ``fsdp_units`` finds the GPT-2 blocks; the
weights of a ``save_pretrained`` directory start a fresh run (``task.init_from_pretrained``) exactly;
what cannot work is a one-line ConfigError."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
transformers = pytest.importorskip("transformers")

from cadence.config.components.compile import CompileConfig  # noqa: E402
from cadence.errors import ConfigError  # noqa: E402
from cadence.export_marker import MARKER_FILE, ExportTargetError  # noqa: E402
from cadence.torch import Context  # noqa: E402
from cadence.torch.experiments.exporting import example_inputs_for  # noqa: E402
from cadence.torch.experiments.runners import build_runners  # noqa: E402
from cadence.torch.export.api import export_task_model, load_exported  # noqa: E402
from cadence.torch.hf import causal_lm_loss, load_pretrained, read_pretrained_state  # noqa: E402
from cadence.torch.hf.save import write_hf  # noqa: E402
from gpt_tasks import TinyGPTTask  # noqa: E402

HEAD, WTE = "lm_head.weight", "transformer.wte.weight"


def tiny_gpt2(*args, **kwargs):
    """hf_tasks.tiny_gpt2, imported on first use: importing GPT-2's modeling takes seconds, which every
    pytest worker would pay in its collection while one runs these tests."""
    from hf_tasks import tiny_gpt2 as make

    return make(*args, **kwargs)


@pytest.fixture(scope="module")
def task():
    from hf_tasks import TinyHFGPT2Task

    return TinyHFGPT2Task(n_tokens=512)


def tied(model) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=x).logits


def test_hf_export_loads_offline_with_equal_logits_tokenizer_and_generate(task, tmp_path):
    model = tiny_gpt2(seed=3)
    directory = str(tmp_path / "export")
    files = export_task_model(task, model, directory, ["hf"], metadata={"step": 7})
    assert files == {"hf": os.path.join(directory, "config.json")}
    names = set(os.listdir(directory))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "metadata.json"} <= names, names
    meta = json.loads((tmp_path / "export" / "metadata.json").read_text())
    assert meta["step"] == 7 and meta["formats"]["hf"]["model_class"] == "GPT2LMHeadModel"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    x = task.example_inputs()[0]
    assert torch.equal(logits(loaded, x), logits(model, x))
    assert tied(loaded)
    assert torch.equal(logits(load_exported(directory, "hf"), x), logits(model, x))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert tokenizer("t1 t5 t3")["input_ids"] == [1, 5, 3]
    out = loaded.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)
    assert out.shape == (2, 8) and torch.equal(out[:, :4], x[:, :4])


def test_hf_export_lists_every_file_it_wrote_and_replaces_only_its_own(task, tmp_path):
    """Issue 39: the marker lists save_pretrained's and the tokenizer's files; a directory of the user's is
    refused, untouched; a user's file added into the export makes it the user's."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text('{"mine": true}')
    with pytest.raises(ExportTargetError, match="holds config.json"):
        export_task_model(task, tiny_gpt2(seed=3), str(tmp_path / "mine"), ["hf"])
    assert os.listdir(tmp_path / "mine") == ["config.json"]
    assert (tmp_path / "mine" / "config.json").read_text() == '{"mine": true}'
    directory = tmp_path / "export"
    for seed in (3, 4):  # the second replaces the first
        export_task_model(task, tiny_gpt2(seed=seed), str(directory), ["hf"], metadata={"seed": seed})
    marker = json.loads((directory / MARKER_FILE).read_text())
    assert sorted([*marker["files"], MARKER_FILE]) == sorted(os.listdir(directory))
    assert {"config.json", "model.safetensors", "tokenizer.json", "metadata.json"} <= set(marker["files"])
    assert json.loads((directory / "metadata.json").read_text())["seed"] == 4
    (directory / "notes.txt").write_text("mine")
    with pytest.raises(ExportTargetError, match="also holds notes.txt"):
        export_task_model(task, tiny_gpt2(seed=5), str(directory), ["hf"])


def test_hf_export_is_sharded_with_an_index_above_max_shard_size(tmp_path):
    model = tiny_gpt2(seed=4)
    info = write_hf(model, str(tmp_path), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(info["weights"]) > 1 and sorted(set(index["weight_map"].values())) == info["weights"]
    assert HEAD not in index["weight_map"]  # tied: stored once
    state = read_pretrained_state(str(tmp_path))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k != HEAD)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    x = torch.arange(16).view(2, 8)
    assert torch.equal(logits(loaded, x), logits(model, x)) and tied(loaded)


def test_fsdp_units_finds_the_gpt2_blocks(task):
    model = task.build_model()
    units = task.fsdp_units(model)
    assert units == list(model.transformer.h) and {type(u).__name__ for u in units} == {"GPT2Block"}


def test_init_from_pretrained_starts_from_exactly_those_weights(task, tmp_path):
    source = tiny_gpt2(seed=5)
    write_hf(source, str(tmp_path / "pretrained"))
    trainer, _ = build_runners(task, Context.create(device="cpu", seed=0), evaluate=False,
                               init_from_pretrained=str(tmp_path / "pretrained"))
    assert trainer is not None
    trainer.initialize()
    model = trainer.model
    assert tied(model)
    expected = source.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    trainer.train(2)  # it trains on from them, the tie intact
    assert tied(model) and not torch.equal(model.state_dict()[WTE], expected[WTE])


def test_init_from_pretrained_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        load_pretrained(tiny_gpt2(), str(tmp_path / "missing"))
    write_hf(tiny_gpt2(vocab=48), str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="shape") as err:
        load_pretrained(tiny_gpt2(vocab=32), str(tmp_path / "other"))
    assert "\n" not in str(err.value)


def test_hf_format_needs_a_transformers_model_and_no_safetensors_beside(task):
    gpt = TinyGPTTask(n_tokens=256)
    with pytest.raises(ConfigError, match="needs a transformers PreTrainedModel.*TinyGPT"):
        example_inputs_for(gpt, ["hf"], "export.formats", gpt.build_model())
    with pytest.raises(ConfigError, match="both write model.safetensors"):
        example_inputs_for(task, ["safetensors", "hf"], "export.formats", task.build_model())


def test_causal_lm_loss_is_the_models_own(task):
    model = tiny_gpt2(seed=6).eval()
    x = task.example_inputs()[0]
    with torch.no_grad():
        own = model(input_ids=x, labels=x)
        assert causal_lm_loss(own) is own.loss
        assert torch.allclose(causal_lm_loss(model(input_ids=x), labels=x), own.loss)
    with pytest.raises(ValueError, match="no loss"):
        causal_lm_loss(model(input_ids=x))


def test_compiled_gpt2_keeps_portable_keys_and_exports(task, tmp_path):
    trainer, _ = build_runners(task, Context.create(device="cpu", seed=0), evaluate=False,
                               compile_config=CompileConfig(backend="eager"))
    assert trainer is not None
    keys = list(trainer.model.state_dict())
    assert keys == list(tiny_gpt2().state_dict()) and not any("_orig_mod" in k for k in keys)
    export_task_model(task, trainer.model, str(tmp_path / "e"), ["hf"])
    state = read_pretrained_state(str(tmp_path / "e"))
    assert all(torch.equal(state[k], v) for k, v in trainer.model.state_dict().items() if k != HEAD)
