"""Tiny Llama checkpoints and an eager prefill on the torch_ref backend, for the model
tests (no executor, no scheduler: the model, its KV cache and a backend)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import make_tiny_hf_model
from parallel_util import load_model
from parallel_util import prefill_batch as build_prefill_batch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.layers.context import LayerContext


@pytest.fixture(scope="session")
def llama8_dir(tmp_path_factory) -> str:
    """A tiny Llama with 8 layers (EAGLE3's aux layers 2, 4, 5 are distinct), 8 query
    and 2 KV heads (tp 2 splits the KV heads, tp 4 replicates them)."""
    path = str(tmp_path_factory.mktemp("tiny-llama8"))
    make_tiny_hf_model(path, "llama", num_hidden_layers=8, num_attention_heads=8)
    return path


@pytest.fixture
def load_llama() -> Callable[[str, LayerContext], torch.nn.Module]:
    """load_llama(model_dir, ctx): the model in float32 on the CPU, built with ctx."""
    return load_model


@pytest.fixture
def prefill_batch() -> Callable[..., ForwardBatch]:
    """prefill_batch(model, prompts, ctx): a PREFILL batch of the prompts (fresh
    requests) over a new KV cache and torch_ref backend holding ctx's heads."""
    return build_prefill_batch
