"""Checkpoint tensors into a model's layers: each layer's own loader (its TP shard),
HF's separate q/k/v and gate/up parts into our packed layers, and strictness (every
parameter loaded, every tensor placed, shapes as the model's)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from gyrfalcon.layers.linear import ColumnParallelLinear

# HF checkpoint name fragment -> (our module name fragment, shard id)
LLAMA_PACKED_MODULES: Mapping[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class WeightLoader:
    """Loads HF-named tensors into `model` one at a time, remembering what it loaded."""

    def __init__(self, model: nn.Module, packed_modules: Mapping[str, tuple[str, str]]):
        self.modules = dict(model.named_modules())
        self.packed_modules = packed_modules
        self.loaded: set[str] = set()  # "param" or "param:shard" for packed layers

    def load(self, name: str, tensor: torch.Tensor, hf_name: str | None = None) -> None:
        """Copy `tensor` (checkpoint name `hf_name`, `name` once its prefix is stripped)
        into its parameter; raises if the model has no place for it."""
        hf_name = hf_name or name
        shard_id = None
        for frag, (ours, sid) in self.packed_modules.items():
            if f".{frag}." in name:
                name, shard_id = name.replace(f".{frag}.", f".{ours}."), sid
                break
        module_name, _, param = name.rpartition(".")
        module = self.modules.get(module_name)
        if module is None or not isinstance(getattr(module, param, None), nn.Parameter):
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        if hasattr(module, "load"):
            module.load(param, tensor, shard_id)
        else:
            target = getattr(module, param)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} is {list(tensor.shape)}, the model's "
                    f"{name} is {list(target.shape)}"
                )
            target.data.copy_(tensor)
        self.loaded.add(name if shard_id is None else f"{name}:{shard_id}")

    def check(self, expected: set[str]) -> None:
        """Raise if a parameter in `expected` was not loaded (a packed one: all its parts)."""
        loaded = set(self.loaded)
        for mod_name, mod in self.modules.items():
            if isinstance(mod, ColumnParallelLinear) and len(mod.shard_ids) > 1:
                for pname in ("weight", "bias") if mod.bias is not None else ("weight",):
                    full = f"{mod_name}.{pname}"
                    if all(f"{full}:{sid}" in loaded for sid in mod.shard_ids):
                        loaded.add(full)
        missing = sorted(n for n in expected if n not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}")
