"""What an EAGLE3 drafter reads from its target model: the residual stream entering
chosen layers (HF's output_hidden_states), the embedding and the LM head as modules."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.hf_weights import iter_hf_weights
from gyrfalcon.models.llama import LlamaForCausalLM, eagle3_aux_layers

TOL = dict(atol=1e-4, rtol=1e-4)
PROMPTS = [[5, 17, 33, 2, 250, 9, 9, 41, 7, 100, 3, 64, 12], [8, 1, 200, 45, 6]]


def hf_outputs(model_dir: str, ids: list[int]):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def test_eagle3_layers():
    assert eagle3_aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    assert eagle3_aux_layers(8) == (2, 4, 5)
    with pytest.raises(ValueError):
        eagle3_aux_layers(2)


def test_aux_outputs_are_the_inputs_of_the_chosen_layers(llama8_dir, load_llama, prefill_batch):
    """aux[j] == HF hidden_states[aux_layers[j]] (the input of that layer) for every row
    of a ragged two-prompt prefill, in float32 on the CPU (the embedding exactly); the
    main output is the plain forward's, bit for bit."""
    ctx = LayerContext()
    model = load_llama(llama8_dir, ctx)
    asked = (0, *eagle3_aux_layers(model.cfg.num_layers), 7)
    with torch.inference_mode():
        hidden, aux = model.forward_aux(prefill_batch(model, PROMPTS, ctx), asked)
        plain = model(prefill_batch(model, PROMPTS, ctx))
    assert torch.equal(hidden, plain)
    assert len(aux) == len(asked) and all(a.shape == hidden.shape for a in aux)
    start = 0
    for ids in PROMPTS:
        rows = slice(start, start + len(ids))
        states, logits = hf_outputs(llama8_dir, ids)
        assert torch.equal(aux[0][rows], states[0])  # the embedding output, exactly
        # NOTE: HF's SDPA and torch_ref attention sum in different orders: a few ulps
        # per layer (one layer's update is O(1), so a wrong layer is far outside this)
        for j, layer in enumerate(asked):
            torch.testing.assert_close(aux[j][rows], states[layer], **TOL)
        torch.testing.assert_close(hidden[rows], states[-1], **TOL)
        torch.testing.assert_close(model.compute_logits(hidden[rows]), logits, atol=1e-4, rtol=0)
        start += len(ids)


def test_aux_layers_must_exist(llama8_dir, load_llama, prefill_batch):
    ctx = LayerContext()
    model = load_llama(llama8_dir, ctx)
    with pytest.raises(ValueError, match=r"aux layer 8 is not in \[0, 8\)"):
        model.forward_aux(prefill_batch(model, PROMPTS, ctx), (2, 8))


def test_a_drafter_shares_the_targets_embedding_and_its_own_lm_head(llama8_dir, load_llama):
    """A drafter built with the target's embedding module holds that very module: its
    checkpoint needs no embedding, and one in it does not overwrite the target's."""
    ctx = LayerContext()
    target = load_llama(llama8_dir, ctx)
    cfg = dataclasses.replace(target.cfg, num_layers=1)
    drafter = LlamaForCausalLM(cfg, ctx, embed_tokens=target.embed_tokens)
    assert drafter.embed_tokens is target.embed_tokens
    kept = ("model.layers.0.", "model.norm.", "lm_head.")
    weights = [(n, t) for n, t in iter_hf_weights(llama8_dir, show_progress=False)]
    embed = dict(weights)["model.embed_tokens.weight"]
    own = [(n, t) for n, t in weights if n.startswith(kept)]
    drafter.load_weights(own + [("model.embed_tokens.weight", torch.zeros_like(embed))])
    ids = torch.tensor(PROMPTS[0])
    assert torch.equal(target.embed(ids), F.embedding(ids, embed))
    assert torch.equal(drafter.embed(ids), target.embed(ids))
    h = torch.randn(3, cfg.hidden_size)
    lm_head = dict(weights)["lm_head.weight"]
    assert torch.equal(drafter.compute_logits(h), F.linear(h, lm_head))
    assert torch.equal(target.compute_logits(h), drafter.compute_logits(h))
