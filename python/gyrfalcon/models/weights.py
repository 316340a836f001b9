"""Checkpoint tensors into a model's layers: each layer's own loader (its TP shard),
HF's separate q/k/v and gate/up parts into our packed layers, MoE experts into our
fused expert weights, and strictness (every parameter loaded, every tensor placed,
shapes as the model's)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from gyrfalcon.layers.linear import ColumnParallelLinear
from gyrfalcon.layers.moe import MoeExperts

# HF checkpoint name fragment -> (our module name fragment, shard id)
LLAMA_PACKED_MODULES: Mapping[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# HF per-expert projection -> its part of our fused expert weights: Qwen3-MoE's names,
# then Mixtral's (w1 gate, w3 up, w2 down)
EXPERT_PARTS: Mapping[str, tuple[str, str]] = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w1": ("w13", "gate"),
    "w3": ("w13", "up"),
    "w2": ("w2", "down"),
}
# transformers 5's fused layout of every expert: [E, 2 I, H] gate then up; [E, H, I]
FUSED_EXPERT_PARAMS: Mapping[str, str] = {"gate_up_proj": "w13", "down_proj": "w2"}
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")


def expert_param(name: str) -> tuple[str, str | None, int | None] | None:
    """(our parameter, shard id, expert) of an HF expert tensor `name` (prefix
    stripped), None for any other tensor:
    "layers.3.mlp.experts.7.up_proj.weight" -> ("layers.3.mlp.experts.w13", "up:7", 7);
    "layers.3.mlp.experts.down_proj" -> ("layers.3.mlp.experts.w2", None, None)."""
    if m := _PER_EXPERT.fullmatch(name):
        module, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj in EXPERT_PARTS:
            param, part = EXPERT_PARTS[proj]
            return f"{module}.{param}", f"{part}:{expert}", expert
    if m := _FUSED_EXPERTS.fullmatch(name):
        return f"{m.group(1)}.{FUSED_EXPERT_PARAMS[m.group(2)]}", None, None
    return None


class WeightLoader:
    """Loads HF-named tensors into `model` one at a time, remembering what it loaded."""

    def __init__(self, model: nn.Module, packed_modules: Mapping[str, tuple[str, str]]):
        self.modules = dict(model.named_modules())
        self.packed_modules = packed_modules
        self.loaded: set[str] = set()  # "param" or "param:shard" for packed layers

    def load(
        self,
        name: str,
        tensor: torch.Tensor,
        hf_name: str | None = None,
        shard_id: str | None = None,
    ) -> None:
        """Copy `tensor` (checkpoint name `hf_name`, `name` once its prefix is stripped)
        into its parameter; raises if the model has no place for it. With `shard_id`,
        `name` is already our parameter's and the tensor is that part of it."""
        hf_name = hf_name or name
        if shard_id is None:
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
            for pname, sids in _packed_params(mod).items():
                full = f"{mod_name}.{pname}"
                if all(f"{full}:{sid}" in loaded for sid in sids):
                    loaded.add(full)
        missing = sorted(n for n in expected if n not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}")


def _packed_params(mod: nn.Module) -> dict[str, list[str]]:
    """The parameters of `mod` loaded in parts: {name: the parts' shard ids}."""
    if isinstance(mod, ColumnParallelLinear) and len(mod.shard_ids) > 1:
        names = ("weight", "bias") if mod.bias is not None else ("weight",)
        return {pname: mod.shard_ids for pname in names}
    if isinstance(mod, MoeExperts):
        return {pname: mod.shard_ids(pname) for pname in ("w13", "w2")}
    return {}
