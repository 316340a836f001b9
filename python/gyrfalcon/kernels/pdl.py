"""The programmatic-dependent-launch gate every decode-path kernel opens with (see
`kernels/device.launch_pdl` for when kernels launch that way)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_gate(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has finished and its writes are visible,
    then let the next kernel be scheduled. Only weights may be read before this."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
