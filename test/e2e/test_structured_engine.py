"""Structured output through the engine (SmolLM2, float32, CPU): sampled generations
against five JSON schemas all parse and validate, with and without EAGLE3; under
EAGLE3 a grammar-constrained greedy request emits exactly what it emits without
speculation while drafts are accepted and refused, and every page comes back."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import SMOLLM2_SHAPE, make_tiny_eagle3
from spec_util import engine, force_drafts, random_pattern, run

from gyrfalcon.grammar.spec import json_schema_output
from gyrfalcon.ipc.messages import SamplingParams

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "votes": {"type": "integer"}},
        "required": ["answer", "votes"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"enum": ["start", "end"]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    "status": {
        "type": "object",
        "properties": {
            "done": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 24},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["done", "note", "level"],
        "additionalProperties": False,
    },
}
PER_SCHEMA = 10
ASK = "Reply with a JSON object about {}, number {}."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("structured") / "draft")
    make_tiny_eagle3(path, **SMOLLM2_SHAPE)
    return path


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return ids if isinstance(ids, list) else ids["input_ids"]


def requests(tokenizer, temperature: float, per_schema: int):
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for i in range(per_schema):
            prompts.append(chat_ids(tokenizer, ASK.format(name, i)))
            so = json_schema_output(schema, strict=True)
            params.append(SamplingParams(temperature=temperature, max_tokens=96, structured=so))
            schemas.append(schema)
    return prompts, params, schemas


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
