"""EAGLE3 drafter checkpoints against their target: the start-up checks.

`validate_draft` runs before any drafter weight is copied (models.registry's
`build_draft_model`), so a pair that cannot work fails at start-up saying what to
fix, never at the first request, and never as silently collapsed acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from gyrfalcon.config.draft_config import DraftConfig, check_draft_config
from gyrfalcon.config.model_config import ModelConfig

OPTIONAL_TENSORS = ("t2d", "embed_tokens.weight")  # derived from d2t; the target's is used


class HasHFState(Protocol):
    """A built drafter: its tensors under their checkpoint names."""

    def hf_state_dict(self) -> dict[str, torch.Tensor]: ...


def draft_to_target_ids(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int, draft_vocab_size: int
) -> torch.Tensor:
    """The target id of every draft id, [draft_vocab] int64: draft id i is target id
    i + d2t[i]. Raises ValueError unless d2t exists, has one offset per draft id, and
    maps the draft vocabulary one-to-one into [0, vocab_size); and, where the
    checkpoint has t2d ([vocab] bool: target id t is a draft token), unless t2d marks
    exactly the target ids d2t reaches."""
    if d2t is None:
        raise ValueError(
            "the drafter checkpoint has no d2t (draft id -> target id offsets): without "
            "it draft tokens would be read as the wrong target tokens"
        )
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t holds {d2t.dtype}; it holds integer offsets")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(
            f"d2t has shape {list(d2t.shape)}; draft_vocab_size is {draft_vocab_size} "
            "(one offset per draft id)"
        )
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t.to(torch.int64)
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ValueError(
            f"d2t maps draft id {i} to target id {int(ids[i])}, outside the target "
            f"vocabulary [0, {vocab_size})"
        )
    hits = torch.bincount(ids, minlength=vocab_size)
    if int(hits.max()) > 1:
        t = int(hits.argmax())
        both = (ids == t).nonzero().flatten()[:2].tolist()
        raise ValueError(f"d2t maps draft ids {both} both to target id {t}: not one-to-one")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab_size,):
            raise ValueError(f"t2d has shape {list(t2d.shape)}; the vocabulary is {vocab_size}")
        diff = (t2d.to(torch.bool) != (hits > 0)).nonzero()
        if diff.numel():
            t = int(diff[0])
            if bool(t2d[t]):
                raise ValueError(
                    f"t2d marks target id {t} as a draft token; no d2t entry maps to it"
                )
            raise ValueError(f"d2t maps a draft id to target id {t}, which t2d does not mark")
    return ids


def validate_draft(
    target: ModelConfig,
    draft: DraftConfig,
    source: Mapping[str, torch.Tensor] | HasHFState,
) -> None:
    """Raise ValueError, saying what to fix, unless the drafter (its checkpoint's
    tensors by name, or a built drafter) can serve this target: the configs fit
    (`check_draft_config`), the vocabulary map is sound (`draft_to_target_ids`), and
    every tensor is there, in the config's shape, with nothing unknown."""
    check_draft_config(target, draft)
    raw = source.hf_state_dict() if hasattr(source, "hf_state_dict") else source
    tensors = {name.removeprefix("model."): t for name, t in raw.items()}
    draft_to_target_ids(
        tensors.get("d2t"), tensors.get("t2d"), target.vocab_size, draft.draft_vocab_size
    )
    shapes = draft.tensor_shapes()
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise ValueError(f"the drafter checkpoint lacks {missing[:8]}")
    unknown = [n for n in tensors if n not in shapes and n not in OPTIONAL_TENSORS]
    if unknown:
        raise ValueError(
            f"the drafter checkpoint holds tensors no EAGLE3 drafter has: {unknown[:8]}"
        )
    lyr = draft.layer
    for name, want in shapes.items():
        have = tuple(tensors[name].shape)
        if have == want:
            continue
        hint = ""
        if ".self_attn." in name:
            hint = (
                f" (the config's {lyr.num_heads} heads and {lyr.num_kv_heads} KV heads of "
                f"head_dim {lyr.head_dim}, over 2 x hidden_size {lyr.hidden_size} inputs)"
            )
        elif name == "fc.weight":
            hint = f" (3 target hidden states of width {draft.target_hidden_size} in)"
        raise ValueError(
            f"drafter tensor {name} is {list(have)}, the config says {list(want)}{hint}"
        )
