"""The real pair: SmolLM2-135M-Instruct and its reviewed EAGLE3 drafter (trained by
`gyrfalcon train-eagle3`, docs/train_eagle3.md), looked for at
../shared/models/smollm2-eagle3 beside the checkout (or $GYRFALCON_REVIEWED_DRAFTER).
Until it is there these tests skip, saying so.

In float32 on the CPU, greedy decoding with the drafter is token-identical to plain
decoding, and the acceptance length on a fixed prompt set (not MT-Bench) is reported
and must not drop below the floor recorded in benchmarks/results/spec_acceptance_floor.json.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from spec_util import engine, run

from gyrfalcon.ipc.messages import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
DRAFTER = Path(
    os.environ.get("GYRFALCON_REVIEWED_DRAFTER") or ROOT.parent / "shared/models/smollm2-eagle3"
)
FLOOR = ROOT / "benchmarks/results/spec_acceptance_floor.json"
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about autumn leaves.",
    "What is 17 times 23? Show your steps.",
    "List three tips for staying focused while studying.",
    "Describe how a bicycle works to a child.",
    "Give me a recipe for a simple tomato soup.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    if not (DRAFTER / "config.json").is_file():
        pytest.skip(f"the reviewed SmolLM2 EAGLE3 drafter is not at {DRAFTER} yet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    return smollm2_dir, str(DRAFTER), ids


def test_reviewed_pair_is_lossless_and_keeps_its_acceptance(pair):
    """Token-identical to plain decoding; the acceptance length is printed (warnings
    summary) and must stay at or above the recorded floor."""
    target, draft, ids = pair
    plain = run(engine(target, page_size=16, num_kv_pages=256), ids, GREEDY)
    got = run(engine(target, draft, 3, page_size=16, num_kv_pages=256), ids, GREEDY)
    assert got.ids == plain.ids
    length = (got.verify_steps + got.accepted) / got.verify_steps
    floor = json.loads(FLOOR.read_text())["floor"]
    message = f"reviewed SmolLM2 pair: acceptance length {length:.2f} (k=3, floor {floor})"
    warnings.warn(message, stacklevel=1)
    assert length >= floor, f"acceptance length {length:.2f} fell below the floor {floor}"
