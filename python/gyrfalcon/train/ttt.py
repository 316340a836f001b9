"""The drafter's differentiable forward, with training-time test (TTT).

The engine's `LlamaForCausalLMEagle3.forward` writes a paged KV cache and runs
inference kernels; this is the same math as plain tensor ops on the SAME
parameters (read from the module, never copied), batched [B, S] with causal SDPA,
so gradients reach them and the trained module is the one the server loads.
test/unit/train/test_ttt_equivalence.py proves step 0 equals a DRAFT_EXTEND and
steps 1, 2 equal DRAFT_DECODE steps fed the previous outputs.

Unroll (full sequence ids t_0..t_{S-1}, target features f_p):

    step 0, row p:  token t_{p+1}, hidden fc(f_p), position p        (DRAFT_EXTEND)
    step j, row p:  token t_{p+1+j}, hidden out_{j-1}[p], position p + j
                    (DRAFT_DECODE: the draft at feature position p + j consumes
                    its own output from position p + j - 1)
    out_j[p] predicts t_{p+2+j}

Row p of step j attends to the keys of step 0 at rows <= p (the features the target
computed: the engine's cached prefix) and to its own row of steps 1..j (the
earlier draft steps of this round): `ttt_mask`, what the engine's cache holds when
it drafts token j + 1 after feature position p, and what SpecForge computes.
NOTE: the EAGLE repository's trainer also masks step-0 keys p - j + 1 .. p at step
j (SafeAILab/EAGLE#247, SpecForge#245): the engine never masks them, so neither
do we.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gyrfalcon.kernels import train_layers
from gyrfalcon.kernels.rotary import build_cos_sin_cache
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3


def ttt_mask(seq_len: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """[S, (step + 1) * S] bool, True where query row p of unroll step `step` attends
    key column c * S + r (row r of step c): c == 0 and r <= p (causal over the
    target's features), or 1 <= c <= step and r == p (its own earlier draft steps)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, S, ...] moved n positions left along dim 1, zero-filled at the end."""
    if n == 0:
        return x
    pad = x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])
    return torch.cat([x[:, n:], pad], dim=1)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """`RMSNorm.forward`'s math (float32 statistics) with norm's weight, differentiable
    (`kernels.train_layers.rms_norm`: fused on CUDA)."""
    return train_layers.rms_norm(x, norm.weight, norm.eps)


def query_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """kv [B, L, KVH, D] -> [B, num_heads, L, D], each KV head repeated for its group of
    query heads (GQA). NOTE: expand, not repeat_interleave: on CUDA that one computes its
    output size on the host from a device tensor, a sync each call."""
    b, length, kv_heads, d = kv.shape
    group = num_heads // kv_heads
    x = kv.transpose(1, 2)[:, :, None].expand(b, kv_heads, group, length, d)
    return x.reshape(b, num_heads, length, d)


def draft_step(
    drafter: LlamaForCausalLMEagle3,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    """One unroll step: ids [B, S], hidden [B, S, H], rope: cos, sin [S, D/2] of this
    step's positions -> out [B, S, H] (pre-final-norm, as `LlamaForCausalLMEagle3.forward`).
    Appends this step's keys and values [B, S, KVH, D] to keys, values; attends per
    `ttt_mask`."""
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    b, s, _ = hidden.shape
    embeds = F.embedding(ids, drafter.embed_tokens.weight).to(hidden.dtype)
    normed = rms_norm(hidden, layer.hidden_norm)
    residual = normed if drafter.cfg.norm_before_residual else hidden
    x = torch.cat([rms_norm(embeds, layer.input_layernorm), normed], dim=-1)  # [B, S, 2H]
    qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).flatten(0, 1)  # [B S, q|k|v]
    if attn.q_norm is not None and attn.k_norm is not None:  # NOTE: per head, before RoPE
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = rms_norm(q.unflatten(-1, (attn.num_heads, attn.head_dim)), attn.q_norm)
        k = rms_norm(k.unflatten(-1, (attn.num_kv_heads, attn.head_dim)), attn.k_norm)
        qkv = torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)
    q, k, v = train_layers.rotate_qkv(qkv, *rope, attn.q_size, attn.kv_size, attn.head_dim)
    keys.append(k.view(b, s, attn.num_kv_heads, attn.head_dim))
    values.append(v.view(b, s, attn.num_kv_heads, attn.head_dim))
    all_k, all_v = (query_heads(torch.cat(kv, dim=1), attn.num_heads) for kv in (keys, values))
    mask = ttt_mask(s, len(keys) - 1, hidden.device)
    out = F.scaled_dot_product_attention(
        q.view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2),
        all_k,
        all_v,
        attn_mask=mask,
        scale=attn.head_dim**-0.5,
    )  # [B, heads, S, D]
    out = out.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim)
    h = F.linear(out, attn.o_proj.weight) + residual
    mlp = layer.mlp
    gate_up = F.linear(rms_norm(h, layer.post_attention_layernorm), mlp.gate_up_proj.weight)
    act = train_layers.silu_mul(gate_up.flatten(0, 1)).view(b, s, -1)
    return h + F.linear(act, mlp.down_proj.weight)


def ttt_unroll(
    drafter: LlamaForCausalLMEagle3, ids: torch.Tensor, aux: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The unrolled drafter over whole sequences: ids [B, S] (t_0..t_{S-1}), aux
    [B, S, 3 Ht] (the target's aux states at each position) -> out_j [B, S, H] for
    j < steps, out_j[:, p] predicting t_{p+2+j} (module docstring)."""
    hidden = F.linear(aux, drafter.fc.weight, drafter.fc.bias)  # `fuse`
    s = ids.shape[1]
    table = build_cos_sin_cache(drafter.midlayer.self_attn.rotary.inv_freq, s + steps)
    cos, sin = (t.contiguous() for t in table.chunk(2, dim=-1))  # [S + steps, D/2] each
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    for j in range(steps):  # NOTE: step j's row p sits at position p + j
        rope = (cos[j : j + s], sin[j : j + s])
        hidden = draft_step(drafter, shift_left(ids, 1 + j), hidden, rope, keys, values)
        outs.append(hidden)
    return outs


def draft_logits(drafter: LlamaForCausalLMEagle3, out: torch.Tensor) -> torch.Tensor:
    """out [..., H] -> [..., draft_vocab] (`compute_logits`: final norm, LM head)."""
    return F.linear(rms_norm(out, drafter.norm), drafter.lm_head.weight)
