"""Import first in a test module whose Triton kernels run in the interpreter (CPU): sets
TRITON_INTERPRET before triton is imported, and skips the importing module on a GPU
machine (kernels compile there once per session; test/gpu covers them, and the variable
is restored) or where the kernels were imported in compiled mode already."""

import os

_PRIOR_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

if torch.cuda.is_available():
    if _PRIOR_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PRIOR_INTERPRET
    pytest.skip("CPU interpreter tests; test/gpu covers CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gyrfalcon.kernels import attention_decode  # noqa: E402

if type(attention_decode._decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the kernels were imported in compiled mode before TRITON_INTERPRET was set",
        allow_module_level=True,
    )
