"""Hugging Face data for training (the hf_gpt2 example's preparation, examples/hf_gpt2/prepare.py):
blocks packed from token ids, a byte-level BPE that ``AutoTokenizer`` loads, and which of ``datasets``'
iteration styles resume exactly through a checkpoint's data position (``state.json``'s JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from by_path import module_loaded
from cadence.torch.data.state import from_json, to_json

PREPARE = Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2" / "prepare.py"
TEXT = "\n".join(f"Checkpoint {i} is committed once its manifest is written; step {i * 7} resumes exactly."
                 for i in range(200))


@pytest.fixture(scope="module")
def prepare():
    with module_loaded("hf_gpt2_prepare", PREPARE) as module:
        yield module


def test_pack_cuts_the_concatenated_rows_into_whole_blocks(prepare):
    packed = prepare.pack({"input_ids": [[1, 2, 3], [4], [5, 6, 7, 8, 9]]}, block_size=4)
    assert packed == {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]]}  # 9, a partial block, is dropped
    assert prepare.pack({"input_ids": [[1, 2]]}, block_size=4) == {"input_ids": []}


def test_the_tokenizer_is_deterministic_and_loads_with_auto_tokenizer(prepare, tmp_path):
    from transformers import AutoTokenizer

    for name in ("a", "b"):
        prepare.train_tokenizer([TEXT], vocab_size=300, model_max_length=64).save_pretrained(str(tmp_path / name))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tokenizer) == 300 and tokenizer.eos_token == prepare.EOS
    ids = tokenizer("Checkpoint 12 is committed. Ünïcödé too")["input_ids"]
    assert tokenizer.decode(ids) == "Checkpoint 12 is committed. Ünïcödé too"  # byte-level: nothing is unknown
    assert len(tokenizer("Checkpoint 12 is committed.")["input_ids"]) < 27 / 2  # 27 bytes: merges learned


def _resumed(make, batches_before: int) -> tuple[list, list]:
    """The batches after ``batches_before`` of a ``StatefulDataLoader`` over ``make()``, and those of a
    new loader restored from the first one's state after a round trip through state.json's JSON."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(make(), batch_size=4)
    it = iter(loader)
    for _ in range(batches_before):
        next(it)
    state = json.loads(json.dumps(to_json(loader.state_dict())))
    rest = [b["x"].tolist() for b in it]
    again = StatefulDataLoader(make(), batch_size=4)
    again.load_state_dict(from_json(state))
    return rest, [b["x"].tolist() for b in again]


def test_an_iterable_dataset_resumes_exactly_without_a_shuffle_buffer_and_not_with_one():
    from datasets import Dataset

    def iterable(buffer_size: int | None):
        data = Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)
        if buffer_size:
            data = data.shuffle(seed=0, buffer_size=buffer_size)
        return data.with_format("torch")

    rest, resumed = _resumed(lambda: iterable(None), 3)
    assert resumed == rest and len(rest) == 13  # its own state_dict: the shard and the example in it
    rest, resumed = _resumed(lambda: iterable(8), 3)
    # datasets does not save a shuffle buffer's examples: they are lost on resume (its documented limit)
    assert resumed != rest and sum(map(len, resumed)) < sum(map(len, rest))


def test_the_example_task_without_prepared_data_names_the_step_to_run(tmp_path):
    from cadence.errors import ConfigError
    from cadence.torch.experiments.task_loader import load_task_class

    task_class = load_task_class(f"{PREPARE.parent / 'task.py'}:GPT2Task")
    with pytest.raises(ConfigError, match=r"task.params.data_dir: no prepared data in .*prepare.py --out"):
        task_class(data_dir=str(tmp_path))
