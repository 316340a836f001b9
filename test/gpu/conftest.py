"""GPU tests: run on the GPU machine with `pytest -m gpu test/gpu`."""

import gc
import os
import traceback

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's frames drop their locals before its report is written (which keeps
    them): else the report holds the test's engine or worker, and its KV cache with it,
    and every later test in the process runs out of memory (stop 68: one failure took 14
    tests with it). The report still shows the traceback's lines."""
    if call.excinfo is not None:
        traceback.clear_frames(call.excinfo.tb)
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session")
def smollm2_gpu_dir(tmp_path_factory) -> str:
    """SmolLM2 converted from a staged GGUF (env GYRFALCON_SMOLLM2_GGUF)."""
    path = os.environ.get("GYRFALCON_SMOLLM2_GGUF")
    if not path or not os.path.exists(path):
        pytest.skip("set GYRFALCON_SMOLLM2_GGUF to the staged SmolLM2 GGUF")
    from gyrfalcon.loader.resolve import resolve_model

    return resolve_model(path, str(tmp_path_factory.mktemp("gguf-cache")))


@pytest.fixture(scope="session")
def tiny_gpu_dir(tmp_path_factory) -> str:
    """A tiny random Llama with head_dim 64 (flashinfer has no kernels for the CPU tests' 16)."""
    from conftest import make_tiny_hf_model

    d = str(tmp_path_factory.mktemp("tiny-gpu"))
    make_tiny_hf_model(d, "llama", hidden_size=256, intermediate_size=512)
    return d


@pytest.fixture
def gpu_engine():
    """Factory: LocalEngine(model dir, backend, dtype, **ServerArgs overrides) on CUDA."""
    from gyrfalcon.config.server_args import ServerArgs
    from gyrfalcon.engine import LocalEngine

    def make(d: str, backend: str, dtype: str, **kw):
        kw = {"page_size": 16, "num_kv_pages": 512, "decode_attention_backend": backend, **kw}
        args = ServerArgs(model=d, device="cuda", dtype=dtype, attention_backend=backend, **kw)
        return LocalEngine(args, d)

    return make
