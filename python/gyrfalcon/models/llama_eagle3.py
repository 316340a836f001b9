"""EAGLE3 draft head (`LlamaForCausalLMEagle3` checkpoints, as SGLang and vLLM load them).

One step of the drafter, for T tokens (both references agree on all of it):

    e        = embed_tokens(ids)                       # the target's embedding, [T, H]
    x        = concat(input_layernorm(e), hidden_norm(hidden))        # [T, 2H]
    residual = hidden        (hidden_norm(hidden) if norm_before_residual: vLLM only)
    h        = residual + o_proj(attention(qkv_proj(x)))      # its own KV, layer 0
    out      = h + mlp(post_attention_layernorm(h))           # -> forward's result
    logits   = lm_head(norm(out))                     # compute_logits, [N, draft_vocab]

`hidden` is `fuse(aux)` = fc(concat of three target hidden states) for tokens the
target has computed (DRAFT_EXTEND), and the drafter's own previous `out` for draft
steps (DRAFT_DECODE): the pre-norm state, as SGLang ("hidden_states_to_aux") and
vLLM (the prenorm half of the final norm's output) feed back.

Token convention: a row pairs the feature at position p with the token at position
p + 1. `batch.positions[j]` is p (the feature's position, whose slot the drafter's
KV takes), `batch.input_ids[j]` the token after it; the output at p predicts the
token at p + 2. For a prompt t_0..t_{n-1} with sampled t_n: features f_0..f_{n-1},
ids t_1..t_n, positions 0..n-1; the last row proposes draft token 1, and the next
step feeds (d_1, out_{n-1}) at position n.

Draft vocabulary: draft id i is target id i + d2t[i] (`to_target_ids`). Rejection
sampling runs in the target vocabulary: scatter the draft distribution q there
(`draft_probs_to_target`, zero outside the draft vocabulary), accept d with
min(1, p(t) / q(t)) for t = to_target_ids(d), resample from norm(max(0, p - q)).
A target distribution read at draft ids (`p[:, draft_to_target]`) drops the mass of
target tokens outside the draft vocabulary; never sample from that.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors.torch import save_file
from torch import nn

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.layers.linear import ColumnParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.loader.eagle3 import draft_to_target_ids
from gyrfalcon.models.llama import LlamaDecoderLayer
from gyrfalcon.models.weights import LLAMA_PACKED_MODULES, WeightLoader


class Eagle3Midlayer(LlamaDecoderLayer):
    """The drafter's decoder layer: a Llama layer whose attention reads
    concat(input_layernorm(embedding), hidden_norm(hidden)), 2H wide."""

    def __init__(self, cfg: DraftConfig, ctx: LayerContext):
        # NOTE: layer id 0 of the drafter's own one-layer KV cache
        super().__init__(cfg.layer, 0, ctx, attn_input_size=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.layer.rms_norm_eps, ctx)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        # embeds, hidden: [T, H] -> the pre-norm output [T, H]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        attn = self.self_attn(positions, self.self_attn.qkv_proj(x), batch)
        # NOTE: a fresh sum, never add_and_norm into `hidden`: that runs in place on
        # CUDA, and hidden is the caller's (a graph's static input, the previous
        # step's output), which a forward only reads (spec-decode bug class 2)
        h = attn + residual
        gate_up, h = self.mlp.gate_up_proj.forward_normed(h, None, self.post_attention_layernorm)
        return h + self.mlp.down_proj.forward_silu_mul(gate_up)


class LlamaForCausalLMEagle3(nn.Module):
    packed_modules = LLAMA_PACKED_MODULES

    def __init__(self, cfg: DraftConfig, ctx: LayerContext, embed_tokens: VocabEmbedding):
        """embed_tokens: the target's embedding, shared (never built, loaded or saved
        here; a checkpoint's own `embed_tokens.weight` is ignored)."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        h = cfg.hidden_size
        self.embed_tokens = embed_tokens
        # NOTE: fc is replicated on every TP rank (all its rows: shards [(0, H)])
        self.fc = ColumnParallelLinear(3 * cfg.target_hidden_size, [h], ctx, shards=[(0, h)])
        self.midlayer = Eagle3Midlayer(cfg, ctx)
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps, ctx)
        self.lm_head = LMHead(cfg.draft_vocab_size, h, ctx)
        # draft id -> target id [draft_vocab]; target id -> draft id or -1 [vocab]
        self.register_buffer(
            "draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False
        )
        self.register_buffer(
            "target_to_draft_ids", torch.empty(cfg.vocab_size, dtype=torch.int64), persistent=False
        )
        self._set_vocab_map(self.draft_to_target.clone())  # identity until loaded

    def aux_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs (`forward_aux`) `fuse` reads, in its order
        (`DraftConfig.aux_layer_ids`: the default, or eagle_config's ids + 1)."""
        return self.cfg.aux_layer_ids(target_num_layers)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [T, 3 * H_target], the three aux hidden states concatenated in
        `aux_layer_ids` order -> [T, H], the `hidden` of a DRAFT_EXTEND forward."""
        return self.fc(aux)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """One drafter step over batch.input_ids (each the token AFTER its row's feature
        position; module docstring) and `hidden` [T, H] (fused target features, or the
        previous step's output) -> the pre-final-norm hidden state [T, H]: what the
        next step consumes, and what `compute_logits` reads. Reads `hidden`, never
        writes it."""
        embeds = self.embed_tokens(batch.input_ids)
        return self.midlayer(batch.positions, embeds, hidden, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (forward's output) -> [N, draft_vocab] logits in the model
        dtype: the final norm, then the LM head."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (id + d2t[id]), any shape."""
        return self.draft_to_target[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -1 for target tokens outside the draft vocabulary."""
        return self.target_to_draft_ids[target_ids]

    @property
    def t2d(self) -> torch.Tensor:
        """[vocab] bool: whether each target id is in the draft vocabulary."""
        return self.target_to_draft_ids >= 0

    def draft_probs_to_target(self, q: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] draft probabilities -> [N, vocab], zero outside the draft
        vocabulary: the q of rejection sampling against the target's p."""
        out = q.new_zeros(q.shape[0], self.cfg.vocab_size)
        out[:, self.draft_to_target] = q
        return out

    def _set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        self.draft_to_target.copy_(draft_to_target)
        self.target_to_draft_ids.fill_(-1)
        self.target_to_draft_ids[self.draft_to_target] = torch.arange(
            self.cfg.draft_vocab_size, device=self.draft_to_target.device
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a checkpoint's tensors (SGLang/vLLM names); raises ValueError naming what
        is missing, unknown, misshapen, or wrong in d2t/t2d (`draft_to_target_ids`)."""
        loader = WeightLoader(self, self.packed_modules)
        vocab_map: dict[str, torch.Tensor] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name in ("d2t", "t2d"):
                vocab_map[name] = tensor
            elif name != "embed_tokens.weight":  # NOTE: the target's embedding is used
                loader.load(name, tensor, hf_name)
        ids = draft_to_target_ids(
            vocab_map.get("d2t"),
            vocab_map.get("t2d"),
            self.cfg.vocab_size,
            self.cfg.draft_vocab_size,
        )
        loader.check({n for n, _ in self.named_parameters() if not n.startswith("embed_tokens.")})
        self._set_vocab_map(ids.to(self.draft_to_target.device))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of this drafter under its checkpoint name (the inverse of
        `load_weights`; the packed layers split into q/k/v and gate/up). TP 1 only."""
        if self.ctx.parallel.tp_size != 1:
            raise ValueError("a drafter holds its full tensors at tp 1 only")
        frag_of = {(ours, sid): frag for frag, (ours, sid) in self.packed_modules.items()}
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            if name.startswith("embed_tokens."):
                continue
            module_name, _, pname = name.rpartition(".")
            layer = self.get_submodule(module_name)
            kind = module_name.rpartition(".")[2]
            if not isinstance(layer, ColumnParallelLinear) or len(layer.shard_ids) == 1:
                out[name] = param.detach()
                continue
            pieces = param.detach().split(layer.local_sizes)
            for sid, piece in zip(layer.shard_ids, pieces):
                out[name.replace(f".{kind}.", f".{frag_of[kind, sid]}.")] = piece
        arange = torch.arange(self.cfg.draft_vocab_size, device=self.draft_to_target.device)
        out["d2t"] = self.draft_to_target - arange
        out["t2d"] = self.t2d
        return out

    def save_pretrained(self, path: str) -> None:
        """config.json and model.safetensors in the format SGLang and vLLM load (and
        `load_weights` reads back bit for bit)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.cfg.to_hf(), f, indent=2)
        tensors = {n: t.to("cpu", copy=True).contiguous() for n, t in self.hf_state_dict().items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
