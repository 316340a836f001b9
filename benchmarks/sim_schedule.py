"""Predict a serving run from the real scheduler and a cost model of the GPU step.

The scheduler (policy, page allocator, overlap bookkeeping) runs unchanged; a
simulated worker answers every plan at once, and each step is charged
    weights / bandwidth + decode KV bytes / bandwidth + prefill FLOPs / peak.
Use it to predict what a scheduling change gains before spending GPU time;
absolute figures are optimistic (no kernel inefficiency, no host time).

  python benchmarks/sim_schedule.py --num-pages 26490 --kv-bytes-per-token 131072
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gyrfalcon.bench.datasets import sample_lengths
from gyrfalcon.ipc.messages import GenerateRequest, RowResult, SamplingParams, StepResult
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-pages", type=int, default=26490, help="usable KV pages")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--conservativeness", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    # defaults: Llama-3.1-8B bf16 on nvidia-h100-x1 (measured 2.93 TB/s read bandwidth)
    p.add_argument("--bandwidth", type=float, default=2.93e12, help="bytes/s")
    p.add_argument("--flops", type=float, default=600e12, help="dense bf16 FLOP/s reached")
    p.add_argument("--weight-bytes", type=float, default=16.06e9)
    p.add_argument("--params", type=float, default=7.5e9, help="matmul parameters per token")
    p.add_argument("--kv-bytes-per-token", type=float, default=131072)
    p.add_argument("--attn-flops-per-token-ctx", type=float, default=4 * 32 * 4096)
    p.add_argument("--step-overhead", type=float, default=0.2e-3, help="seconds per step")
    a = p.parse_args()

    rng = np.random.default_rng(a.seed)
    ins = sample_lengths(rng, a.num_prompts, a.input_len, a.range_ratio)
    outs = sample_lengths(rng, a.num_prompts, a.output_len, a.range_ratio)
    cfg = SchedulerConfig(
        num_pages=a.num_pages + 1,  # page 0 is the dummy page
        page_size=a.page_size,
        max_model_len=1 << 20,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=16384,
        chunked_prefill_size=8192,
        eos_token_ids=(),
        max_inflight=1,
        conservativeness=a.conservativeness,
    )
    s = Scheduler(cfg)
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        sp = SamplingParams(max_tokens=n_out, ignore_eos=True)
        s.add_request(GenerateRequest(str(i), [5] * n_in, sp))

    seconds, steps, prefill_tokens, resets, queue = 0.0, 0, 0, 0, []

    def submit(plan) -> None:
        nonlocal seconds, steps, prefill_tokens, resets
        t = a.weight_bytes / a.bandwidth + a.step_overhead
        for row in plan.batches[0].rows:
            n, ctx = len(row.input_ids), row.start + len(row.input_ids)
            resets += row.reset
            if n == 1:
                t += ctx * a.kv_bytes_per_token / a.bandwidth
            else:
                prefill_tokens += n
                flops = n * (2 * a.params + a.attn_flops_per_token_ctx * (row.start + n / 2))
                t += flops / a.flops
        seconds += t
        steps += 1
        rows = [RowResult(r.rid, [7] if r.sample else []) for r in plan.batches[0].rows]
        queue.append(StepResult(plan.step_id, rows))

    while s.has_work():
        s.pump(submit, lambda: queue.pop(0))
    print(
        json.dumps(
            {
                "seconds": round(seconds, 1),
                "steps": steps,
                "output_tok_s": round(sum(outs) / seconds),
                "prompt_tokens": sum(ins),
                "prefill_tokens_computed": prefill_tokens,
                "preempted_rows_reset": resets,
            }
        )
    )


if __name__ == "__main__":
    main()
