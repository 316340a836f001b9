"""KV sizing on CUDA keeps the largest step's activations free: the profile measures
the peak of the worst-case steps on a KV cache of two pages and frees it; the KV cache
sized after it leaves that much free even where --mem-fraction asks for nearly all of
the device; where the graphs then leave less than the peak free, the warm-up shrinks
the cache and captures again; its last check (the same steps beside the real KV cache
and graphs) passes, and the worker then serves."""

import gc

import pytest
import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.worker import kv_sizing
from gyrfalcon.worker.kv_sizing import max_model_len, num_kv_pages, profile_context
from gyrfalcon.worker.memory_profile import fit_kv_cache, memory_shortfall, step_peak_bytes
from gyrfalcon.worker.step_worker import StepWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "arch, slack", [("llama", None), ("qwen3-moe", None), ("llama", 0)],
    ids=["llama", "qwen3-moe", "llama-no-slack"],
)  # fmt: skip
def test_kv_cache_leaves_the_largest_step_room(tmp_path, monkeypatch, arch, slack):
    """slack 0: sizing keeps nothing free for the graphs, so their capture leaves the
    largest step short and the cache must shrink."""
    from conftest import make_tiny_hf_model

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    gc.collect()  # NOTE: the last case's worker and its KV cache go first
    torch.cuda.empty_cache()
    model, tok = str(tmp_path / "m"), str(tmp_path / "tok")
    extra = {"moe_intermediate_size": 64} if arch == "qwen3-moe" else {}
    make_tiny_hf_model(model, arch, num_attention_heads=4, hidden_size=256, **extra)
    make_synthetic_tokenizer(model, tok)
    args = ServerArgs(
        model=model, tokenizer=tok, device="cuda", dtype="bfloat16",
        attention_backend="triton", mem_fraction=0.99 if slack is None else 1.0,
    ).resolved()  # fmt: skip
    cfg = ModelConfig.from_dir(model)
    if slack is not None:  # NOTE: and all of the device for weights and KV: the peak binds
        monkeypatch.setattr(kv_sizing, "SLACK_BYTES", slack)
    worker = StepWorker(args, cfg, model)
    try:
        peak = worker.step_peak = step_peak_bytes(worker, profile_context(args, cfg))
        assert peak > 0 and worker.executor.kv_cache is None and not worker.requests
        dtype = args.kv_dtype(worker.executor.dtype)
        pages = num_kv_pages(args, cfg, dtype, worker.device, 1, None, peak)
        context = max_model_len(args, cfg, pages)
        worker.init_kv_cache(pages, context)
        free, total = torch.cuda.mem_get_info(worker.device)
        reserved = torch.cuda.memory_reserved(worker.device)
        cached = reserved - torch.cuda.memory_allocated(worker.device)
        if slack is None:  # what 0.99 of the device would not leave
            assert free + cached >= peak, (free, cached, peak)
        assert free < 0.05 * total  # yet the KV cache took the rest
        worker.warm_up(context)  # ends with the profile's steps beside the KV cache: they fit
        assert not worker.requests and not worker.pending
        assert memory_shortfall(worker) == 0
        if slack == 0:
            assert worker.executor.kv_cache.num_pages < pages  # the graphs' share came out
            assert worker.executor.graphs is not None
            # capturing again gives back all the last capture took: a cache 512 MiB
            # smaller leaves that much more free, less at most 16 MiB (a capture used to
            # leave a cuBLAS workspace of 32 MiB behind on a stream of its own)
            torch.cuda.empty_cache()
            before, _ = torch.cuda.mem_get_info(worker.device)
            per_page = kv_sizing.kv_page_bytes(args, cfg, dtype, 1)
            fit_kv_cache(worker, short=512 << 20)
            torch.cuda.empty_cache()
            after, _ = torch.cuda.mem_get_info(worker.device)
            freed = -(-(512 << 20) // per_page) * per_page
            assert after - before >= freed - (16 << 20), (before, after, freed)
    finally:  # NOTE: the next case's KV cache needs the device (and test/gpu/conftest.py
        # clears a failure's frames)
        del worker
        gc.collect()
        torch.cuda.empty_cache()
