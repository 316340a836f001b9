"""Baseline: HF transformers `generate` tokens/s on the same model and shapes as bench_serving.

Random token-id prompts of --input-len, exactly --output-len new tokens (EOS
ignored through min_new_tokens), greedy, at each --batch-size (left padding).
Writes JSON with `bench`, `device_kind`, `model`, `commit` and rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF dir (default: the embedded SmolLM2)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-kind", default="cpu-2core", help="label recorded in the JSON")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from gyrfalcon.bench.provenance import git_commit
    from gyrfalcon.loader.resolve import resolve_model

    model_dir = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        ids = torch.randint(1000, 30000, (bs, args.input_len), generator=gen)
        mask = torch.ones_like(ids)
        kw = dict(
            attention_mask=mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=0,
        )
        model.generate(
            ids[:, :8],
            **{**kw, "attention_mask": mask[:, :8], "max_new_tokens": 2, "min_new_tokens": 2},
        )  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        dt = time.perf_counter() - t0
        new = (out.shape[1] - args.input_len) * bs
        rows.append({"batch_size": bs, "seconds": dt, "output_tokens": new, "tok_s": new / dt})
        print(f"batch {bs:4d}: {new} tokens in {dt:.2f} s -> {new / dt:.1f} tok/s", flush=True)
    result = {
        "bench": "hf_generate",
        "device_kind": args.device_kind,
        "model": model_dir,
        "commit": git_commit(),
        "dtype": args.dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
