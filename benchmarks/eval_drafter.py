#!/usr/bin/env python3
"""Offline acceptance of an EAGLE3 drafter on a prompt set: what `train-eagle3`
reports on its held-out prompts, measured on any prompts.

The target answers each prompt greedily (our engine), its aux features are computed
over prompt + answer, and the drafter is unrolled over them as in training
(train/objective.py: acceptance per draft step given the earlier ones accepted,
and the mean acceptance length at k). Compared with the acceptance a server
measures on the same prompts (bench_spec.py), a gap says the serving path loses
drafts; equal figures on MT-Bench and lower than on the training prompts say the
drafter does not generalize.

    python benchmarks/eval_drafter.py --draft-model drafters/smollm2-eagle3 \\
        --prompts ../shared/data/mt_bench_dev.jsonl            # first turns
    python benchmarks/eval_drafter.py --draft-model drafters/smollm2-eagle3 \\
        --prompts ../shared/data/train_prompts.jsonl --skip 2500 --num-prompts 40
        # the training file's seeded order past the --num-prompts it trained on

Several --draft-model directories are measured on the same answers (generated once),
so their `rounds_per_sequence` pair prompt by prompt (benchmarks/compare_drafters.py);
one line each, and --output-json takes one path per drafter (optional).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
from safetensors.torch import load_file

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.kernels.dispatch import TORCH_REFERENCE
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.resolve import resolve_model
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.train.args import TrainArgs
from gyrfalcon.train.data import encode_prompts, generate_answers, load_prompts
from gyrfalcon.train.evaluate import evaluate
from gyrfalcon.train.features import Features, compute_features
from gyrfalcon.train.trainer import target_runner


def read_prompts(path: str, skip: int, num: int, seed: int) -> list[str]:
    """MT-Bench style lines ('turns': the first one) in file order, else the 'prompt'
    field in the seeded order `train-eagle3` draws from (`load_prompts`)."""
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline())
    if "turns" in first:
        with open(path, encoding="utf-8") as f:
            prompts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    else:
        prompts = load_prompts(path, 0, seed)
    return prompts[skip : skip + num] if num else prompts[skip:]


def load_drafter(
    path: str, target: torch.nn.Module, device: torch.device
) -> LlamaForCausalLMEagle3:
    """The checkpoint at `path` in float32, sharing the target's embedding."""
    cfg = DraftConfig.from_dir(path)
    with torch.device(device):
        drafter = LlamaForCausalLMEagle3(
            cfg, LayerContext(kernels=TORCH_REFERENCE), target.embed_tokens
        )
    weights = load_file(os.path.join(path, "model.safetensors"))
    drafter.load_weights((n, t.float() if t.is_floating_point() else t) for n, t in weights.items())
    return drafter.eval()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    p.add_argument(
        "--draft-model", required=True, nargs="+",
        help="EAGLE3 drafter directories: each is measured on the same answers",
    )  # fmt: skip
    p.add_argument("--prompts", required=True, help="jsonl: 'turns' (first one) or 'prompt'")
    p.add_argument("--skip", type=int, default=0, help="prompts skipped first")
    p.add_argument("--num-prompts", type=int, default=0, help="prompts used (0: the rest)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=3, help="draft steps unrolled")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--seed", type=int, default=0, help="the order of 'prompt' files")
    p.add_argument("--kv-cache-memory", default=None, help="the engine's (default: sized)")
    p.add_argument(
        "--output-json", nargs="*", default=[],
        help="one path per --draft-model, in their order",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.output_json and len(a.output_json) != len(a.draft_model):
        p.error(f"--output-json: {len(a.output_json)} paths for {len(a.draft_model)} drafters")
    return a


def main(argv: list[str] | None = None) -> int:
    """The target answers once; each drafter is measured on those answers (the features
    computed once per set of aux layers), so their rounds pair prompt by prompt."""
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_dir = resolve_model(a.target_model)
    prompts = read_prompts(a.prompts, a.skip, a.num_prompts, a.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or model_dir)
    # NOTE: triton on CUDA, as train-eagle3 generates (no flashinfer module build)
    backend = "triton" if device.type == "cuda" else "auto"
    server_args = ServerArgs(
        model=model_dir, tokenizer=a.tokenizer, device=a.device, dtype=dtype,  # type: ignore[arg-type]
        seed=a.seed, attention_backend=backend, kv_cache_memory=a.kv_cache_memory,
    )  # fmt: skip
    engine = LocalEngine(server_args, model_dir, check_invariants=False)
    seqs = generate_answers(engine, encode_prompts(tokenizer, prompts, True), a.max_new_tokens)
    runner = target_runner(engine)
    target_cfg = ModelConfig.from_dir(model_dir)
    feats_by_aux: dict[tuple[int, ...], Features] = {}
    answers = torch.tensor([t for s in seqs for t in s.ids[s.prompt_len :]], device=device)
    answer_tokens = answers.numel()
    args = dataclasses.replace(TrainArgs(), ttt_steps=a.k, batch_size=8)
    for i, path in enumerate(a.draft_model):
        drafter = load_drafter(path, runner.model, device)
        aux = tuple(drafter.cfg.aux_layer_ids(target_cfg.num_layers))
        if aux not in feats_by_aux:
            feats_by_aux[aux] = compute_features(runner, seqs, aux, device)
        acc = evaluate(drafter, runner.model, feats_by_aux[aux], args, device)
        # NOTE: a token outside the draft vocabulary is never drafted: this bounds every rate
        coverage = float(drafter.t2d[answers].float().mean()) if answer_tokens else 0.0
        result = {
            "prompts": a.prompts,
            "skip": a.skip,
            "sequences": len(seqs),
            "answer_tokens": answer_tokens,
            "draft_model": path,
            "k": a.k,
            "device": a.device,
            "dtype": dtype,
            "acceptance_per_step": acc.rates,
            "mean_acceptance_length": acc.length,
            # NOTE: tokens per verify step of k-draft rounds over the answers, as a server counts
            "served_acceptance_length": acc.served_length,
            # NOTE: per prompt, in order: (verify steps, tokens); paired comparisons of two
            # drafters on one machine's answers (benchmarks/compare_drafters.py)
            "rounds_per_sequence": [list(r) for r in acc.rounds],
            "draft_vocab_coverage": coverage,
        }
        per_step = ", ".join(f"{r:.3f}" for r in acc.rates)
        name = f"{path}: " if len(a.draft_model) > 1 else ""
        print(
            f"{name}{os.path.basename(a.prompts)} [{a.skip}:+{len(seqs)}]: acceptance per draft "
            f"step [{per_step}], mean acceptance length {acc.length:.2f} (k={a.k}), "
            f"{acc.served_length:.2f} in rounds as served; "
            f"{coverage:.3f} of answer tokens in the draft vocabulary",
            flush=True,
        )
        if a.output_json:
            with open(a.output_json[i], "w") as f:
                json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
