"""Structured output on the GPU (SmolLM2 staged, triton, CUDA graphs): the bitmask's
pinned upload and unpacking on the device; sampled outputs against five schemas parse
and validate, with and without EAGLE3 (a random drafter), and a grammar-constrained
greedy request under EAGLE3 with forced drafts emits what it does without (float32)."""

import json

import jsonschema
import pytest
from spec_util import force_drafts, random_pattern, run
from structured_util import PER_SCHEMA, load_tokenizer, random_drafter, requests

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokenizer(smollm2_gpu_dir):
    return load_tokenizer(smollm2_gpu_dir)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    return random_drafter(tmp_path_factory.mktemp("structured-gpu"))


def spec_kw(drafter: str) -> dict:
    return dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter,
        speculative_num_steps=3,
    )  # fmt: skip


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3"])
def test_sampled_outputs_parse_and_validate_on_the_gpu(
    smollm2_gpu_dir, gpu_engine, drafter, tokenizer, speculative
):
    prompts, params, schemas = requests(tokenizer, 0.9, PER_SCHEMA)
    kw = spec_kw(drafter) if speculative else {}
    out = run(gpu_engine(smollm2_gpu_dir, "triton", "bfloat16", **kw), prompts, params)
    for ids, final, schema in zip(out.ids, out.final, schemas):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert final.finish_reason == "stop", (final.finish_reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_eagle3_under_a_grammar_emits_what_plain_decoding_does_on_the_gpu(
    smollm2_gpu_dir, gpu_engine, drafter, tokenizer
):
    prompts, params, _ = requests(tokenizer, 0.0, 1)
    plain = run(gpu_engine(smollm2_gpu_dir, "triton", "float32"), prompts, params)
    eng = gpu_engine(smollm2_gpu_dir, "triton", "float32", **spec_kw(drafter))
    sequences = {str(i): p + o for i, (p, o) in enumerate(zip(prompts, plain.ids))}
    force_drafts(eng, sequences, random_pattern(0, 3), 3)
    spec = run(eng, prompts, params)
    assert spec.ids == plain.ids and spec.accepted > 0
