"""Text from an ``hf`` export of the hf_gpt2 example, through ``transformers`` alone (no cadence):

    python examples/hf_gpt2/generate.py runs/hf_gpt2/export/best/300 --prompt "A checkpoint"

Loads the export with ``AutoModelForCausalLM`` and ``AutoTokenizer`` (offline) and prints the
prompt continued greedily by ``--tokens`` tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", help="an export/<on>/<step>/ directory of the hf format")
    parser.add_argument("--prompt", default="A checkpoint")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.export_dir)
    model = AutoModelForCausalLM.from_pretrained(args.export_dir)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
