"""EAGLE3 drafter configuration: the drafter's config.json, normalized once.

A drafter checkpoint in the format SGLang and vLLM load (`LlamaForCausalLMEagle3`)
is one Llama decoder layer (the "midlayer") whose attention reads
concat(embedding, hidden), an `fc` fusing three target hidden states, a final norm
and an LM head over a draft vocabulary. `DraftConfig.layer` is that decoder layer
as a `ModelConfig`, so the Llama layers build it unchanged.

Aux layers, the convention honoured here (SGLang's, and the trainers' that write
the field): `eagle_config.eagle_aux_hidden_state_layer_ids` [j0, j1, j2] names
target layers whose OUTPUTS the drafter reads, i.e. the inputs of layers j + 1
(HF `hidden_states[j + 1]`, what `LlamaForCausalLM.forward_aux(batch, [j + 1])`
returns). vLLM reads the same ids unshifted (inputs of layers j); its own
top-level `eagle_aux_hidden_state_layer_ids` (the speculators layout, which SGLang
ignores) does mean inputs, and is read as such. Without ids: the inputs of layers
(2, N // 2, N - 3), where both agree. docs/spec_decode.md has the details.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from gyrfalcon.config.model_config import ModelConfig

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3  # fc reads three target hidden states


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE3 drafter reads by default:
    (2, N // 2, N - 3), as in SGLang and vLLM."""
    if num_layers < 3:
        raise ValueError(f"EAGLE3 needs at least 3 target layers, not {num_layers}")
    return 2, num_layers // 2, num_layers - 3


def _aux_ids(hf: dict[str, Any]) -> tuple[int, ...] | None:
    """The aux ids in eagle_config's convention (outputs of layers), from
    eagle_config (as written) or vLLM's top-level key (inputs of layers: minus one)."""
    nested = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    ids = None if nested is None else tuple(int(j) for j in nested)
    if top is not None:
        from_top = tuple(int(i) - 1 for i in top)
        if ids is not None and ids != from_top:
            raise ValueError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)} (outputs of "
                f"layers) and the top-level eagle_aux_hidden_state_layer_ids {list(top)} "
                "(inputs of layers) name different target layers"
            )
        ids = from_top
    if ids is not None and len(ids) != NUM_AUX_LAYERS:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids has {len(ids)} layers; an EAGLE3 fc reads "
            f"{NUM_AUX_LAYERS}"
        )
    return ids


@dataclass(frozen=True)
class DraftConfig:
    layer: ModelConfig  # the midlayer as a one-layer Llama; vocab_size is the target's
    draft_vocab_size: int  # rows of the LM head; d2t maps them into the target vocabulary
    target_hidden_size: int  # width of each target hidden state fc reads (3 of them)
    eagle_aux_layer_ids: tuple[int, ...] | None = None  # as eagle_config writes them
    norm_before_residual: bool = False  # vLLM/speculators: residual = hidden_norm(hidden)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    def aux_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs (HF hidden_states[i], `forward_aux`) the
        drafter reads, in fc's order; raises if the target has no such layer."""
        if self.eagle_aux_layer_ids is None:
            return default_aux_layers(target_num_layers)
        layers = tuple(j + 1 for j in self.eagle_aux_layer_ids)
        for j, i in zip(self.eagle_aux_layer_ids, layers):
            if not 0 <= i < target_num_layers:
                raise ValueError(
                    f"eagle_aux_hidden_state_layer_ids names the output of layer {j} (the "
                    f"input of layer {i}); the target's {target_num_layers} layers have "
                    f"inputs 0..{target_num_layers - 1}"
                )
        return layers

    def with_max_positions(self, max_positions: int) -> DraftConfig:
        """This config with rotary tables for at least max_positions positions (drafter
        configs often say 2048 while the target serves far longer contexts)."""
        most = max(self.layer.max_position_embeddings, max_positions)
        return dataclasses.replace(
            self, layer=dataclasses.replace(self.layer, max_position_embeddings=most)
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold (HF names) and its shape. `t2d` [vocab]
        and `embed_tokens.weight` are optional and not listed."""
        lyr = self.layer
        h, two_h, hd = lyr.hidden_size, 2 * lyr.hidden_size, lyr.head_dim
        q, kv, inter = lyr.num_heads * hd, lyr.num_kv_heads * hd, lyr.intermediate_size
        attn, mlp = "midlayer.self_attn", "midlayer.mlp"
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, NUM_AUX_LAYERS * self.target_hidden_size),
            f"{attn}.q_proj.weight": (q, two_h),
            f"{attn}.k_proj.weight": (kv, two_h),
            f"{attn}.v_proj.weight": (kv, two_h),
            f"{attn}.o_proj.weight": (h, q),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            f"{mlp}.gate_proj.weight": (inter, h),
            f"{mlp}.up_proj.weight": (inter, h),
            f"{mlp}.down_proj.weight": (h, inter),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
        }
        if lyr.qkv_bias:
            shapes.update(
                {f"{attn}.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
            )
        if lyr.qk_norm:
            shapes.update({f"{attn}.{p}_norm.weight": (hd,) for p in ("q", "k")})
        return shapes

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DraftConfig:
        arch = (hf.get("architectures") or [None])[0]
        if arch not in EAGLE3_ARCHITECTURES:
            raise ValueError(
                f"a drafter checkpoint has architecture {EAGLE3_ARCHITECTURES[0]!r}, not {arch!r}"
            )
        if hf.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"EAGLE3 drafters with {hf['num_hidden_layers']} decoder layers are not "
                "supported (one midlayer)"
            )
        if not (hf.get("eagle_config") or {}).get("use_aux_hidden_state", True):
            raise ValueError("EAGLE3 drafters without aux hidden states are not supported")
        # NOTE: the midlayer is a Llama decoder layer: parse it as one (rope, norms, heads)
        layer = ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
        return cls(
            layer=layer,
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
            eagle_aux_layer_ids=_aux_ids(hf),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
        )

    @classmethod
    def from_dir(cls, path: str) -> DraftConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))

    def to_hf(self) -> dict[str, Any]:
        """config.json in the format SGLang and vLLM load (`from_hf` gives self back)."""
        lyr = self.layer
        hf: dict[str, Any] = {
            "architectures": [EAGLE3_ARCHITECTURES[0]],
            "model_type": "qwen3" if lyr.qk_norm else "llama",
            "num_hidden_layers": 1,
            "hidden_size": lyr.hidden_size,
            "intermediate_size": lyr.intermediate_size,
            "num_attention_heads": lyr.num_heads,
            "num_key_value_heads": lyr.num_kv_heads,
            "head_dim": lyr.head_dim,
            "hidden_act": lyr.hidden_act,
            "attention_bias": lyr.qkv_bias,
            "rms_norm_eps": lyr.rms_norm_eps,
            "rope_theta": lyr.rope_theta,
            "rope_scaling": lyr.rope_scaling,
            "max_position_embeddings": lyr.max_position_embeddings,
            "tie_word_embeddings": False,
            "vocab_size": lyr.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "bos_token_id": lyr.bos_token_id,
            "eos_token_id": list(lyr.eos_token_ids) or None,
            "torch_dtype": lyr.torch_dtype,
        }
        if self.eagle_aux_layer_ids is not None:
            ids = list(self.eagle_aux_layer_ids)
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        if self.norm_before_residual:
            hf["norm_before_residual"] = True
        return hf


def check_draft_config(target: ModelConfig, draft: DraftConfig) -> None:
    """Raise ValueError, with what to fix, if the drafter cannot serve this target: its
    vocabulary, the width of the features fc reads, the width of the shared embedding,
    its attention heads, its aux layers."""
    lyr = draft.layer
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the drafter's vocab_size {draft.vocab_size} is not the target's "
            f"{target.vocab_size}: it was trained for another tokenizer"
        )
    if not 1 <= draft.draft_vocab_size <= draft.vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft.draft_vocab_size} is not in [1, vocab_size "
            f"{draft.vocab_size}]"
        )
    if draft.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"the drafter's fc reads target hidden states of width "
            f"{draft.target_hidden_size} (target_hidden_size, else hidden_size); this "
            f"target's are {target.hidden_size}: it was trained for another target"
        )
    if draft.hidden_size != target.hidden_size:
        raise ValueError(
            f"the drafter's hidden_size {draft.hidden_size} differs from the target's "
            f"{target.hidden_size}: it embeds tokens with the target's embedding"
        )
    if lyr.num_heads % lyr.num_kv_heads:
        raise ValueError(
            f"the drafter's {lyr.num_heads} attention heads do not group over "
            f"{lyr.num_kv_heads} KV heads"
        )
    if lyr.head_dim % 2:
        raise ValueError(f"the drafter's head_dim {lyr.head_dim} is odd: RoPE needs it even")
    draft.aux_layer_ids(target.num_layers)  # raises for layers the target lacks
