#!/usr/bin/env python3
"""Memory of the largest steps, step by step: the steps KV sizing measures at start-up
(`worker/warmup.profile_batches`: a prefill of --max-num-batched-tokens over
--max-num-seqs rows, then every row decoding or verifying k drafts, every sampling
feature on) run through a `StepWorker` on a KV cache of two pages, each step's peak
beyond what was resident before it reported.

On CUDA the peak is torch's (`max_memory_allocated`); on the CPU it is the process's
peak resident set (VmHWM, reset before each step), which counts the same tensors.
--shrink keeps a model's vocabulary and shrinks the rest (4 layers, hidden 64, 8 experts),
so that the sampler's share, which scales with the vocabulary and the rows, shows on a
CPU; the weights are dummy (random).

    PYTHONPATH=python python3 benchmarks/profile_step_memory.py \
        --model benchmarks/models/qwen3-30b-a3b --draft benchmarks/models/qwen3-30b-a3b-eagle3 \
        --shrink --device cpu --device-kind cpu --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from gyrfalcon.bench.provenance import git_commit  # noqa: E402
from gyrfalcon.config.model_config import ModelConfig  # noqa: E402
from gyrfalcon.config.server_args import ServerArgs  # noqa: E402
from gyrfalcon.worker.step_worker import StepWorker  # noqa: E402
from gyrfalcon.worker.warmup import profile_batches  # noqa: E402

TARGET_SHRINK = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, num_local_experts=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip
DRAFT_SHRINK = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, target_hidden_size=64,
)  # fmt: skip


def shrunk(src: str, dst: Path, overrides: dict) -> str:
    """A copy of the config in `src` with `overrides` (keys it has) into dst."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.update({k: v for k, v in overrides.items() if k in cfg})
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class Meter:
    """Peak bytes of one step beyond what was resident before it."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            self.base = _status_mib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # NOTE: resets VmHWM

    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        return _status_mib("VmHWM") - self.base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", help="an EAGLE3 drafter's dir: the steps verify k drafts")
    ap.add_argument("--steps", type=int, default=3, help="k, with --draft")
    ap.add_argument("--shrink", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--output-json")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    model, draft = a.model, a.draft
    if a.shrink:
        model = shrunk(model, tmp / "model", TARGET_SHRINK)
        draft = draft and shrunk(draft, tmp / "draft", DRAFT_SHRINK)
    spec = {}
    if draft:
        spec = dict(
            speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
            speculative_num_steps=a.steps,
        )  # fmt: skip
    args = ServerArgs(
        model=model, device=a.device, dtype=a.dtype, load_format="dummy",
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        chunked_prefill_size=a.chunked_prefill_size, enforce_eager=True, **spec,
    ).resolved()  # fmt: skip
    cfg = ModelConfig.from_dir(model)
    worker = StepWorker(args, cfg, model)
    worker.executor.alloc_kv_cache(2)
    if worker.drafter is not None:
        worker.drafter.init_kv_cache(2, args.kv_dtype(worker.executor.dtype))
    context = cfg.max_position_embeddings
    worker.max_model_len = context
    meter = Meter(worker.device)
    steps = []
    budget, seqs, chunk = a.max_num_batched_tokens, a.max_num_seqs, a.chunked_prefill_size
    batches = profile_batches(args.page_size, budget, seqs, chunk, context, worker.num_draft)
    for i, rb in enumerate(batches):
        meter.start()
        worker.submit_batch(-1 - i, rb)
        worker.take()
        tokens = sum(len(r.input_ids) + r.num_draft for r in rb.rows)
        steps.append(dict(mode=rb.forward_mode.name, rows=len(rb.rows), tokens=tokens,
                          peak_mib=round(meter.peak_mib(), 1)))  # fmt: skip
        print(f"{steps[-1]['mode']:8s} {len(rb.rows):4d} rows {tokens:6d} tokens: "
              f"+{steps[-1]['peak_mib']:,.0f} MiB", flush=True)  # fmt: skip
    out = dict(
        bench="profile_step_memory", device_kind=a.device_kind, commit=git_commit(),
        model=a.model, draft=a.draft, shrink=a.shrink, vocab_size=cfg.vocab_size,
        num_draft=worker.num_draft, measure="torch max_memory_allocated"
        if worker.device.type == "cuda" else "VmHWM (peak RSS)", steps=steps,
    )  # fmt: skip
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
