"""Structured output through the engine (SmolLM2, float32, CPU): sampled generations
against five JSON schemas all parse and validate, with and without EAGLE3; under
EAGLE3 a grammar-constrained greedy request emits exactly what it emits without
speculation while drafts are accepted and refused, and every page comes back."""

from __future__ import annotations

import json

import jsonschema
import pytest
from spec_util import engine, force_drafts, random_pattern, run
from structured_util import PER_SCHEMA, load_tokenizer, random_drafter, requests


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    return random_drafter(tmp_path_factory.mktemp("structured"))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3"])
def test_sampled_outputs_parse_and_validate(smollm2_dir, drafter, tokenizer, speculative):
    prompts, params, schemas = requests(tokenizer, 0.9, PER_SCHEMA)
    eng = engine(smollm2_dir, drafter if speculative else None, k=3, page_size=16, num_kv_pages=512)
    out = run(eng, prompts, params)
    for ids, final, schema in zip(out.ids, out.final, schemas):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert final.finish_reason == "stop", (final.finish_reason, text)
        jsonschema.validate(json.loads(text), schema)
    if speculative:
        assert out.verify_steps > 0


def test_eagle3_under_a_grammar_emits_what_plain_decoding_does(smollm2_dir, drafter, tokenizer):
    """Forced drafts: the constrained greedy continuation, right for a random number of
    positions and then off by one id (mostly tokens the grammar refuses)."""
    prompts, params, _ = requests(tokenizer, 0.0, 1)
    plain = run(engine(smollm2_dir, page_size=16, num_kv_pages=512), prompts, params)
    eng = engine(smollm2_dir, drafter, k=3, page_size=16, num_kv_pages=512)
    sequences = {str(i): p + o for i, (p, o) in enumerate(zip(prompts, plain.ids))}
    made = force_drafts(eng, sequences, random_pattern(0, 3), 3)
    spec = run(eng, prompts, params)
    assert spec.ids == plain.ids
    assert spec.accepted > 0 and any(right < 3 for _, _, right in made)
