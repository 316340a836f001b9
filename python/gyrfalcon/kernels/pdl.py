"""The programmatic-dependent-launch gate every decode-path kernel opens with (see
`kernels/device.launch_pdl` for when kernels launch that way)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_gate(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has finished and its writes are visible,
    then let the next kernel be scheduled. Before this a kernel may read only what no
    kernel of the forward writes: weights; the batch's metadata (lengths, positions,
    the cos/sin table, page tables), which is written before the forward's first
    kernel; and the KV cache at positions before the step's new tokens, written by
    earlier steps (every kernel before the previous one has finished when this one
    starts, so only the previous kernel may still be writing)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
