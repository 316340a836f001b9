"""`train-eagle3 --data-cache FILE`: the generated training text kept between runs.

Generation is most of a run's time; trying a training setting again should not
repeat it. The file holds the sequences (prompt ids + answer ids, the held-out ones
last), the kept self-written instructions, and the key they were made under: every
argument that changes the text, the target's resolved directory and a digest of the
drawn prompts. A run whose key differs generates again and replaces the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import torch

from gyrfalcon.train.data import TrainSequence

FORMAT = 1
# the arguments that decide the generated text (TrainArgs field names)
KEY_ARGS = (
    "tokenizer",
    "no_chat_template",
    "num_prompts",
    "holdout",
    "self_instructions",
    "instruction_examples",
    "follow_up_turns",
    "max_new_tokens",
    "dtype",
    "seed",
)


def data_key(args: Any, model_dir: str, prompts: Sequence[str]) -> dict[str, Any]:
    """What the generated text depends on: KEY_ARGS of `args` (a TrainArgs), the
    target's resolved directory and a sha256 of the drawn prompts."""
    digest = hashlib.sha256("\0".join(prompts).encode()).hexdigest()
    key = {name: getattr(args, name) for name in KEY_ARGS}
    return {**key, "target_model_dir": model_dir, "prompts_sha256": digest}


def save_data(
    path: str, key: dict[str, Any], instructions: list[str], seqs: Sequence[TrainSequence]
) -> None:
    """Write the sequences and instructions under `key` (atomically: a run stopped
    midway leaves the old file or none)."""
    ids = [t for s in seqs for t in s.ids]
    record = {
        "format": FORMAT,
        "key": key,
        "instructions": list(instructions),
        "ids": torch.tensor(ids, dtype=torch.int32),
        "lengths": torch.tensor([len(s.ids) for s in seqs], dtype=torch.int64),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(record, tmp)
    os.replace(tmp, path)


def load_data(path: str, key: dict[str, Any]) -> tuple[list[str], list[TrainSequence]] | str:
    """(instructions, sequences) saved under `key`, or why not (no file, another
    format, or the key entries that differ)."""
    if not os.path.exists(path):
        return f"{path} does not exist yet"
    record = torch.load(path, weights_only=True)
    if record.get("format") != FORMAT:
        return f"{path} has format {record.get('format')}, not {FORMAT}"
    saved = record["key"]
    differ = sorted(k for k in key.keys() | saved.keys() if key.get(k) != saved.get(k))
    if differ:
        return f"{path} was generated with other arguments ({', '.join(differ)} differ)"
    flat = record["ids"].tolist()
    seqs, start = [], 0
    for n, p in zip(record["lengths"].tolist(), record["prompt_lens"].tolist(), strict=True):
        seqs.append(TrainSequence(flat[start : start + n], p))
        start += n
    assert start == len(flat), f"{path}: lengths do not cover the ids"
    return list(record["instructions"]), seqs
