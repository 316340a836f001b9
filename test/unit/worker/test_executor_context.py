"""The executor makes one LayerContext per model and hands it to everything that runs
kernels: the layers, the KV cache, the attention backends and the argmax; with a
TP rank's parallel context they all hold that rank's heads."""

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.worker.executor import ModelExecutor
from gyrfalcon.worker.kv_sizing import num_kv_pages

CPU = torch.device("cpu")


def build(model_dir: str, parallel: ParallelContext | None = None, **kw) -> ModelExecutor:
    cfg = ModelConfig.from_dir(model_dir)
    args = ServerArgs(model=model_dir, device="cpu", dtype="float32", **kw).resolved(cfg)
    extra = {} if parallel is None else {"parallel": parallel}
    executor = ModelExecutor(args, cfg, model_dir, CPU, **extra)
    executor.init_kv_cache(num_pages=8, max_model_len=64)
    return executor


def test_disable_pdl_reaches_every_layer_the_cache_and_the_backends(tiny_model_dirs):
    for disable in (False, True):
        ex = build(tiny_model_dirs["qwen3"], disable_pdl=disable)  # qk-norm: more norms
        assert ex.ctx.kernels == KernelPolicy(fused=True, pdl=not disable)
        holders = [m for m in ex.model.modules() if hasattr(m, "kernels")]
        assert len(holders) > 10 and all(m.kernels is ex.ctx.kernels for m in holders)
        assert ex.kv_cache.kernels is ex.ctx.kernels
    # a second executor in the same process keeps its own policy (nothing process-wide)
    assert build(tiny_model_dirs["llama"]).ctx.kernels.pdl and not ex.ctx.kernels.pdl


def test_a_tp_rank_holds_its_heads_in_model_cache_and_backends(tiny_model_dirs):
    """tiny llama: 4 query and 2 KV heads; rank 1 of tp 2 holds 2 and 1 of them."""
    d = tiny_model_dirs["llama"]
    ex = build(d, ParallelContext(1, 2))
    assert (ex.heads.num_heads, ex.heads.num_kv_heads) == (2, 1)
    assert ex.kv_cache.k.shape[2] == 1
    attn = ex.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    for mode in (ForwardMode.PREFILL, ForwardMode.DECODE):
        backend = ex.backend_for(mode)
        assert (backend.num_heads, backend.num_kv_heads) == (2, 1)
    cfg = ModelConfig.from_dir(d)
    args = ServerArgs(model=d, device="cpu", kv_cache_memory="1MB").resolved(cfg)
    # a page holds this rank's KV heads only: half of them, twice the pages
    assert num_kv_pages(args, cfg, torch.float32, CPU, 2) == 2 * num_kv_pages(
        args, cfg, torch.float32, CPU, 1
    )
