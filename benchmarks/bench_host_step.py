#!/usr/bin/env python3
"""Host time a decode step costs per row, on the CPU: the scheduler's and the worker's.

A small model's served step is a chain through the processes (benchmarks/NOTES.md,
stop 52): the scheduler plans step N+2 from step N's result while the device runs
N+1, and the worker launches it, so at SmolLM2's 1.4 ms device step for 256 rows
the host decides the token rate. This measures the two Python halves of that chain
at steady decode, N running requests, without a GPU:

- scheduler: the real `Scheduler` (policy, pages, prefix cache, plan builder) and
  its side of the wire (the plan encoded, each result decoded, the outputs encoded);
  a fake worker answers every row with one token (its own time is not counted);
- worker: the real `StepWorker` on a tiny dummy Llama (`--worker-model`), the plans
  from a real scheduler; its host time is `submit` + `take` minus the model's forward
  (`ModelExecutor.forward`), which on the CPU runs the model itself.

Both halves run with the collector as the server's processes set it once serving
(`gc_heap.freeze_startup_heap`: the heap frozen before the requests arrive), or with
CPython's defaults (`--stock-gc`). Figures are the best of `--repeats` runs of
`--steps` steps (the CPU is shared); CPU figures stand in for the GPU host's, which
runs the same Python (plus launches).

    python benchmarks/bench_host_step.py --rows 64 256 --output-json host.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import msgspec
import torch

from gyrfalcon.bench import report_json
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.gc_heap import freeze_startup_heap
from gyrfalcon.ipc.messages import (
    BatchOutput,
    GenerateRequest,
    RowResult,
    SamplingParams,
    SchedulerToWorker,
    StepPlan,
    StepResult,
    WorkerToScheduler,
)
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE_SIZE = 16
# a Llama small enough that its CPU forward does not drown the host time it is
# subtracted from (the worker's Python does not depend on the model's size)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _requests(n: int, prompt_len: int, max_tokens: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    # NOTE: prompts differ from their first token: no prefix-cache hits between them
    return [GenerateRequest(str(i), [3 + i % 400] + [5] * (prompt_len - 1), sp) for i in range(n)]


def scheduler_step_us(
    rows: int, dp: int, prompt_len: int, steps: int, repeats: int, freeze: bool = True
) -> float:
    """The scheduler's CPU seconds per decode step (plan, its wire side, results)."""
    cfg = SchedulerConfig(
        num_pages=rows * (prompt_len + 4 * steps * repeats) // PAGE_SIZE + 64,
        page_size=PAGE_SIZE,
        max_model_len=1 << 20,
        max_num_seqs=rows // dp,
        max_num_batched_tokens=1 << 20,
        chunked_prefill_size=1 << 20,
        eos_token_ids=(2,),
        max_inflight=2,
        dp_size=dp,
        prefix_caching=True,
        conservativeness=0.0,  # admit all at once (the reserve is not measured)
    )
    sched = Scheduler(cfg)
    if freeze:
        freeze_startup_heap()
    for req in _requests(rows, prompt_len, 1 << 20):
        sched.add_request(req)
    enc = msgspec.msgpack.Encoder()
    plan_dec = msgspec.msgpack.Decoder(SchedulerToWorker)
    result_dec = msgspec.msgpack.Decoder(WorkerToScheduler)
    results: list[bytes] = []
    worker_s = 0.0  # the fake worker's own time, taken out of the pump's

    def submit(plan: StepPlan) -> None:
        nonlocal worker_s
        wire = enc.encode(plan)
        t = time.perf_counter()
        plan = plan_dec.decode(wire)
        for rank, batch in enumerate(plan.batches):
            out = [RowResult(r.rid, [7] if r.sample else []) for r in batch.rows]
            results.append(enc.encode(StepResult(plan.step_id, out, rank)))
        worker_s += time.perf_counter() - t

    def receive() -> StepResult:
        return result_dec.decode(results.pop(0))

    def run(n: int) -> float:
        nonlocal worker_s
        worker_s = 0.0
        t = time.perf_counter()
        for _ in range(n):
            outputs = sched.pump(submit, receive)
            if outputs:
                enc.encode(BatchOutput(outputs))
        return time.perf_counter() - t - worker_s

    run(20)  # the prompts' steps
    assert len(sched.running) == rows, f"{len(sched.running)} of {rows} running"
    return _best(lambda: run(steps), repeats) / steps


def _tiny_model_dir(root: str) -> str:
    path = Path(root) / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def worker_step_us(
    rows: int, prompt_len: int, steps: int, repeats: int, model_dir: str, freeze: bool = True
) -> dict[str, float]:
    """The worker's host seconds per decode step (submit + take - the model's forward)
    and the forward's; the plans come from LocalEngine's scheduler."""
    args = ServerArgs(
        model=model_dir,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_num_seqs=rows,
        num_kv_pages=rows * (prompt_len + 4 * steps * repeats) // PAGE_SIZE + 64,
        page_size=PAGE_SIZE,
        max_num_batched_tokens=rows * prompt_len,
        chunked_prefill_size=rows * prompt_len,
        schedule_conservativeness=0.0,
    )
    eng = LocalEngine(args, model_dir, check_invariants=False)
    if freeze:
        freeze_startup_heap()
    for req in _requests(rows, prompt_len, 1 << 20):
        eng.scheduler.add_request(req)
    for _ in range(4):
        eng.step()
    assert len(eng.scheduler.running) == rows, f"{len(eng.scheduler.running)} running"
    spent = {"forward": 0.0, "worker": 0.0}
    timed(eng.worker.executor, "forward", spent, "forward")
    timed(eng.worker, "submit", spent, "worker")
    timed(eng.worker, "take", spent, "worker")

    def run() -> dict[str, float]:
        for key in spent:
            spent[key] = 0.0
        for _ in range(steps):
            eng.step()
        return {k: v / steps for k, v in spent.items()}

    best = min((run() for _ in range(repeats)), key=lambda r: r["worker"] - r["forward"])
    return {"worker": best["worker"] - best["forward"], "forward": best["forward"]}


def timed(obj: object, name: str, spent: dict[str, float], key: str) -> None:
    """Wrap obj.name so that its wall time adds to spent[key]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def _best(run: Callable[[], float], repeats: int) -> float:
    gc.collect()
    return min(run() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="running requests")
    p.add_argument("--dp-size", type=int, default=1, help="the scheduler's DP ranks")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-worker", action="store_true", help="the scheduler only")
    p.add_argument("--stock-gc", action="store_true", help="CPython's collector settings")
    p.add_argument("--output-json")
    a = p.parse_args()
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _tiny_model_dir(tmp)
        for n in a.rows:
            run = {"rows": n, "dp_size": a.dp_size}
            freeze = not a.stock_gc
            sched = scheduler_step_us(n, a.dp_size, a.prompt_len, a.steps, a.repeats, freeze)
            run["scheduler_us_per_step"] = round(sched * 1e6, 1)
            run["scheduler_us_per_row"] = round(sched * 1e6 / n, 2)
            if not a.no_worker:
                w = worker_step_us(n, a.prompt_len, a.steps, a.repeats, model_dir, freeze)
                run["worker_us_per_step"] = round(w["worker"] * 1e6, 1)
                run["worker_us_per_row"] = round(w["worker"] * 1e6 / n, 2)
                run["cpu_forward_us_per_step"] = round(w["forward"] * 1e6, 1)
            runs.append(run)
            print(
                f"rows {n:5d}: scheduler {run['scheduler_us_per_row']:6.2f} us/row"
                + (f", worker {run['worker_us_per_row']:6.2f} us/row" if not a.no_worker else "")
            )
    report = {
        "bench": "host_step",
        "device_kind": "cpu",
        "commit": git_commit(),
        "prompt_len": a.prompt_len,
        "steps": a.steps,
        "repeats": a.repeats,
        "gc": "stock" if a.stock_gc else "frozen start-up heap (gc_heap.py)",
        "runs": runs,
    }
    if a.output_json:
        report_json.write(a.output_json, report)


if __name__ == "__main__":
    main()
