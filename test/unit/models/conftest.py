"""Tiny Llama checkpoints and an eager prefill on the torch_ref backend, for the model
tests (no executor, no scheduler: the model, its KV cache and a backend)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import make_tiny_hf_model

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.registry import build_model

CPU = torch.device("cpu")
PAGE = 4


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

    def load(model_dir: str, ctx: LayerContext) -> torch.nn.Module:
        cfg = ModelConfig.from_dir(model_dir)
        return build_model(cfg, model_dir, torch.float32, CPU, ctx, show_progress=False)

    return load


@pytest.fixture
def prefill_batch() -> Callable[..., ForwardBatch]:
    """prefill_batch(model, prompts, ctx): a PREFILL batch of the prompts (fresh
    requests) over a new KV cache and torch_ref backend holding ctx's heads."""

    def build(model, prompts: list[list[int]], ctx: LayerContext) -> ForwardBatch:
        cfg = model.cfg
        heads = ctx.parallel.heads(cfg.num_heads, cfg.num_kv_heads)
        backend = TorchRefBackend(
            heads.num_heads, heads.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5
        )
        rows, next_page = [], 1  # page 0 is the dummy page
        for ids in prompts:
            n = -(-len(ids) // PAGE)
            rows.append(RowInput(0, ids, list(range(next_page, next_page + n))))
            next_page += n
        cache = KVCache(
            cfg.num_layers, next_page, PAGE, heads.num_kv_heads, cfg.head_dim, torch.float32, CPU
        )
        bt = build_batch_tensors(rows, PAGE, CPU)
        batch = ForwardBatch.from_tensors(ForwardMode.PREFILL, bt, PAGE, cache, backend)
        batch.attn_meta = backend.build_metadata(batch)
        return batch

    return build
