"""A synthetic tokenizer for models served with dummy weights (no real tokenizer at hand).

Token i is the word "<i>" (delimited, so no token is a prefix of another); words
are split on whitespace; special tokens are the model's bos/eos ids. Detokenizing
costs about what a real fast tokenizer costs, so serving benchmarks on dummy
weights stay representative of the frontend.
"""

from __future__ import annotations

import argparse
import os

from gyrfalcon.config.model_config import ModelConfig


def make_synthetic_tokenizer(model_dir: str, out_dir: str) -> str:
    """Write a fast tokenizer with the model's vocabulary size into out_dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = ModelConfig.from_dir(model_dir)
    vocab = {f"<{i}>": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.vocab_size - 1
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<0>", eos_token=f"<{eos}>", bos_token=f"<{bos}>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir", help="directory with the model's config.json")
    ap.add_argument("out_dir")
    ns = ap.parse_args()
    print(make_synthetic_tokenizer(ns.model_dir, ns.out_dir))


if __name__ == "__main__":
    main()
