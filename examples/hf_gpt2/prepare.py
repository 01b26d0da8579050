"""Prepares the hf_gpt2 example's data offline: a byte-level BPE tokenizer trained with ``tokenizers``
on local text, and that text tokenized and packed into fixed blocks as ``datasets`` Arrow on disk.

    python examples/hf_gpt2/prepare.py --out runs/hf_gpt2_data

The text is the repository's own Markdown (``docs/**/*.md`` and ``README.md``, about 250 kB) unless
``--text`` names other files or folders (their ``*.md``, ``*.py`` and ``*.txt`` files); at most
``--max-bytes`` are read. Each file is one document (``load_dataset("text", sample_by="document")``);
every tenth file in sorted order is held out for validation. ``OUT`` then holds:

- ``tokenizer/``: ``tokenizer.json`` and its config, loadable with ``AutoTokenizer.from_pretrained``;
- ``train/``, ``validation/``: ``datasets`` saved with ``save_to_disk``, one column ``input_ids`` of
  ``--block-size`` token ids per row (the documents' tokens, each followed by ``<|endoftext|>``,
  concatenated and cut into blocks; the last partial block is dropped).

Nothing is downloaded (``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` are set); the same text gives
the same files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"
SUFFIXES = (".md", ".py", ".txt")


def text_files(sources: Iterable[Path], max_bytes: int) -> list[Path]:
    """The files of ``sources`` (a folder: its ``*.md``, ``*.py``, ``*.txt``, recursively), sorted,
    up to ``max_bytes`` in all (at least one file)."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            files += sorted(p for p in source.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif source.is_file():
            files.append(source)
        else:
            raise SystemExit(f"prepare.py: --text {source}: no such file or folder")
    kept, total = [], 0
    for path in files:
        size = path.stat().st_size
        if kept and total + size > max_bytes:
            break
        kept.append(path)
        total += size
    if not kept:
        raise SystemExit("prepare.py: no text files found in --text")
    return kept


def pack(batch: dict[str, list[Any]], block_size: int) -> dict[str, list[list[int]]]:
    """A batched ``Dataset.map`` function: the ``input_ids`` of the batch's rows concatenated and cut
    into rows of ``block_size`` ids; the tail shorter than a block is dropped."""
    ids = [i for row in batch["input_ids"] for i in row]
    n = len(ids) // block_size * block_size
    return {"input_ids": [ids[i: i + block_size] for i in range(0, n, block_size)]}


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int):
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``, as a ``PreTrainedTokenizerFast``
    whose beginning, end and unknown token is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   model_max_length=model_max_length)


def prepare(out: Path, sources: list[Path], *, vocab_size: int = 1024, block_size: int = 64,
            max_bytes: int = 1_000_000) -> dict[str, int]:
    """Writes ``out/tokenizer``, ``out/train`` and ``out/validation`` (see the module doc); returns
    the number of blocks of each split."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    files = text_files(sources, max_bytes)
    held_out = files[9::10] if len(files) >= 2 else []
    splits = {"train": [str(p) for p in files if p not in held_out], "validation": [str(p) for p in held_out]}
    if not splits["validation"]:
        splits["validation"] = splits["train"]  # one file: validate on the training text
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    texts = load_dataset("text", data_files=splits, sample_by="document", cache_dir=str(cache))
    tokenizer = train_tokenizer(texts["train"]["text"], vocab_size, block_size)
    tokenizer.save_pretrained(str(out / "tokenizer"))

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"], verbose=False)["input_ids"]]}

    counts = {}
    for split, documents in texts.items():
        tokens = documents.map(tokenize, batched=True, remove_columns=["text"], keep_in_memory=True)
        blocks = tokens.map(pack, batched=True, fn_kwargs={"block_size": block_size}, keep_in_memory=True)
        if len(blocks) == 0:
            raise SystemExit(f"prepare.py: the {split} text holds fewer than --block-size {block_size} tokens")
        shutil.rmtree(out / split, ignore_errors=True)
        blocks.save_to_disk(str(out / split))
        counts[split] = len(blocks)
    del texts
    shutil.rmtree(cache, ignore_errors=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/hf_gpt2_data"), help="where to write (%(default)s)")
    parser.add_argument("--text", type=Path, nargs="+", default=[ROOT / "docs", ROOT / "README.md"],
                        help="files or folders of text (default: the repository's docs and README)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-bytes", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    counts = prepare(args.out, args.text, vocab_size=args.vocab_size, block_size=args.block_size,
                     max_bytes=args.max_bytes)
    print(f"wrote {args.out}: tokenizer/, train/ ({counts['train']} blocks of {args.block_size} tokens), "
          f"validation/ ({counts['validation']} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
