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
