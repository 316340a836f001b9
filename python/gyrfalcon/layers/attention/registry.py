"""Build attention backends by name; imports are lazy so CPU never imports GPU code.

A model gets one instance per role (`create_backends`): each instance keeps its
own plans and graph buffers, so a step of one role never overwrites the plan of
another (a verify step's and a draft step's in one plan, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gyrfalcon.forward.batch import SINGLE_TOKEN_MODES
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy
from gyrfalcon.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from gyrfalcon.layers.attention.flashinfer_backend import FlashInferWorkspace


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class called `name`, imported on demand."""
    if name == "torch_ref":
        from gyrfalcon.layers.attention.torch_ref import TorchRefBackend

        return TorchRefBackend
    if name == "triton":
        from gyrfalcon.layers.attention.triton_backend import TritonBackend

        return TritonBackend
    if name == "flashinfer":
        from gyrfalcon.layers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend
    raise ValueError(
        f"unknown attention backend {name!r} (available: torch_ref, triton, flashinfer)"
    )


def create_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    kernels: KernelPolicy = DEFAULT_KERNELS,
    workspace: FlashInferWorkspace | None = None,
) -> AttentionBackend:
    """num_heads, num_kv_heads: the heads this rank holds; kernels: the model's kernel
    policy (PDL launches of the triton backend's kernels)."""
    cls = backend_class(name)
    if name == "triton":
        return cls(num_heads, num_kv_heads, head_dim, scale, kernels=kernels)
    if name == "flashinfer":
        return cls(num_heads, num_kv_heads, head_dim, scale, workspace=workspace)
    return cls(num_heads, num_kv_heads, head_dim, scale)


@dataclass(frozen=True)
class RoleBackends:
    """The attention backends of one model, one instance per role."""

    extend: AttentionBackend  # PREFILL, MIXED, DRAFT_EXTEND, IDLE
    decode: AttentionBackend  # DECODE, DRAFT_DECODE (one token per row)
    verify: AttentionBackend  # VERIFY (k + 1 tokens per row)

    def for_mode(self, mode: ForwardMode) -> AttentionBackend:
        if mode in SINGLE_TOKEN_MODES:
            return self.decode
        if mode == ForwardMode.VERIFY:
            return self.verify
        return self.extend


def create_backends(
    extend: str,
    decode: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    kernels: KernelPolicy = DEFAULT_KERNELS,
    verify: str | None = None,
) -> RoleBackends:
    """Backends named `extend`, `decode` and `verify` (default: `extend`, as VERIFY rows
    are extends), a separate instance per role; flashinfer instances share one float
    workspace."""
    verify = verify or extend
    workspace = None
    if "flashinfer" in (extend, decode, verify):
        from gyrfalcon.layers.attention.flashinfer_backend import FlashInferWorkspace

        workspace = FlashInferWorkspace()

    def make(name: str) -> AttentionBackend:
        shape = (num_heads, num_kv_heads, head_dim, scale)
        return create_backend(name, *shape, kernels=kernels, workspace=workspace)

    return RoleBackends(extend=make(extend), decode=make(decode), verify=make(verify))
