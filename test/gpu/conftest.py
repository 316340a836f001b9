"""GPU tests: run on the GPU machine with `pytest -m gpu test/gpu`."""

import os

import pytest


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
