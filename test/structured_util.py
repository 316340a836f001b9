"""Structured-output requests for the engine tests (CPU and GPU): five bounded JSON
schemas, chat prompts of the embedded SmolLM2 asking for them."""

from __future__ import annotations

from conftest import SMOLLM2_SHAPE, make_tiny_eagle3

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


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def random_drafter(root) -> str:
    """A random EAGLE3 drafter of SmolLM2's shape under `root` (a pathlib.Path)."""
    path = str(root / "draft")
    make_tiny_eagle3(path, **SMOLLM2_SHAPE)
    return path
