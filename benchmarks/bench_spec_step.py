#!/usr/bin/env python3
"""Cost of one speculative step (verify k + 1 tokens per row, then the drafter's
round) against one plain decode step, at fixed batch sizes: the in-process engine
(scheduler + worker, as the server runs them), every row in decode, EOS ignored.

A step's cost does not depend on acceptance (the shapes are fixed by k), so a dummy
drafter measures it. Reports per batch size the wall time per steady-state step of
each engine (total over the steps it planned), their ratio (the goal for the
Llama-3.1-8B shape: <= 1.35x at batch 1) and the tokens emitted per step.

With --arrival-len P it also measures what a request arriving into the running batch
costs: a prompt of P tokens is added (and the oldest row aborted, so the batch stays
at bs) every --arrival-every steps; the extra wall time over that many steady steps,
per arrival, is the cost of the step that prefills it beside the decoding rows (a
MIXED step: eager, with the drafter's round over every row in the spec engine).

    python benchmarks/bench_spec_step.py benchmarks/models/llama-3.1-8b \
        benchmarks/models/llama-3.1-8b-eagle3 --load-format dummy --device-kind nvidia-h100-x1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import gyrfalcon  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch

from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.gc_heap import GcPauses, freeze_startup_heap
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.profiling import SectionTimes, host_profile
from gyrfalcon.worker.sections import worker_sections


def step_times(
    eng: LocalEngine, bs: int, prompt_len: int, steps: int, seed: int, timed=None, planned=None
) -> tuple[float, float]:
    """(seconds per steady-state step, tokens emitted per step): wall time over `steps`
    steps the scheduler planned (a spec step may span two scheduler turns: it plans
    the next step only once a row's accepted count is back). `timed`: a context
    manager around the steady steps only (a profiler); `planned`, a list, gets the
    number of steps planned."""
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.model_cfg.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=steps * 8 + 64, ignore_eos=True)
    for i in range(bs):
        eng.add(f"r{i}", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), sp)
    while any(r.num_computed < len(r.prompt_ids) for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    for _ in range(8):
        eng.step()  # warm: every row decoding
    with timed if timed is not None else contextlib.nullcontext():
        elapsed, n, emitted = _timed_steps(eng, steps)
    if planned is not None:
        planned.append(n)
    for i in range(bs):
        eng.abort(f"r{i}")
    while eng.has_work():
        eng.step()
    return elapsed / n, emitted / n


def _timed_steps(
    eng: LocalEngine, steps: int, between: Callable[[int], None] | None = None
) -> tuple[float, int, int]:
    """Step until `steps` steps are planned, calling `between(planned)` after each
    engine turn, then take the results in flight unless `between` keeps adding work;
    (wall seconds, steps planned, tokens emitted)."""
    submit, planned = eng.worker.submit, [0]

    def counted(plan):
        planned[0] += 1
        submit(plan)

    eng.worker.submit = counted
    if eng.args.device == "cuda":
        torch.cuda.synchronize()
    emitted = 0
    t0 = time.perf_counter()
    while planned[0] < steps:
        emitted += sum(len(o.token_ids) for o in eng.step())
        if between is not None:
            between(planned[0])
    # the last steps' results, planning nothing more (a turn of eng.step() would plan
    # again, and so run every request to its max_tokens)
    while between is None and eng.scheduler.num_inflight:
        emitted += sum(len(o.token_ids) for o in eng.scheduler.process_result(eng.worker.take()))
    elapsed = time.perf_counter() - t0
    eng.worker.submit = submit
    return elapsed, planned[0], emitted


def arrival_cost(
    eng: LocalEngine, bs: int, ns: argparse.Namespace, step_s: float, seed: int
) -> float:
    """Seconds a request of ns.arrival_len prompt tokens adds when it arrives into a
    running batch of bs decoding rows (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.model_cfg.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    live: list[str] = []

    def add(n: int) -> None:
        live.append(f"a{seed}-{len(live)}-{n}-{time.monotonic_ns()}")
        eng.add(live[-1], torch.randint(3, vocab, (n,), generator=gen).tolist(), sp)

    for _ in range(bs):
        add(ns.prompt_len)
    while any(r.num_computed < len(r.prompt_ids) for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(8):
        eng.step()
    done = [0]

    def arrive(planned: int) -> None:
        if done[0] < ns.arrivals and planned >= done[0] * ns.arrival_every:
            eng.abort(live.pop(0))
            add(ns.arrival_len)
            done[0] += 1

    total_s, total_steps, _ = _timed_steps(eng, ns.arrivals * ns.arrival_every, arrive)
    for rid in live:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    return (total_s - total_steps * step_s) / ns.arrivals


def profile(eng: LocalEngine, bs: int, ns: argparse.Namespace, path: str) -> None:
    """step_times at batch bs under cProfile; the top functions by own and cumulative time.
    On CUDA, then the device side: the kernels of 20 steady steps by total time, with
    their launch counts (beside `path`, kernels_*.txt)."""
    with host_profile(path):
        step_times(eng, bs, ns.prompt_len, ns.steps, bs)
    if eng.args.device != "cuda":
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as kernel_profile

    steps = 20
    kprof = kernel_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    planned: list[int] = []
    step_s, tokens = step_times(eng, bs, ns.prompt_len, steps, bs, timed=kprof, planned=planned)
    steps = planned[0]
    events = [e for e in kprof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = kprof.key_averages().table(
        sort_by="cuda_time_total", row_limit=60, max_name_column_width=80
    )
    out = os.path.join(os.path.dirname(path), "kernels_" + os.path.basename(path))
    lines = []  # per planned step: device us and launches of each kernel, by time
    for e in kprof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0 and e.key and not e.key.startswith("aten::"):
            lines.append((us / steps, e.count / steps, e.key[:100]))
    lines.sort(reverse=True)
    total = sum(u for u, _, _ in lines)
    with open(out, "w") as f:
        f.write(
            f"{steps} steady steps at batch {bs}: "
            f"{len(events)} device events, {step_s * 1e3:.3f} ms a step under the profiler, "
            f"{tokens:.2f} tokens a step\n"
            f"per step: {total:.1f} us of kernels, {sum(n for _, n, _ in lines):.0f} launches\n"
        )
        f.writelines(f"{u:9.1f} us {n:7.1f} x  {k}\n" for u, n, k in lines)
        f.write(f"\n{table}\n")


def time_sections(eng: LocalEngine, bs: int, ns: argparse.Namespace, name: str) -> None:
    """SectionTimes of steady steps at batch bs, then of arrivals (with --arrival-len),
    to <output-dir>/sections_<engine>_bs<bs>.md."""
    planned: list[int] = []
    with SectionTimes(section_targets()) as steady:
        step_times(eng, bs, ns.prompt_len, ns.steps, bs, planned=planned)
    text = f"# {name} engine, batch {bs}: {planned[0]} steady steps\n\n"
    text += steady.table(planned[0], "step")
    if ns.arrival_len:
        with SectionTimes(section_targets()) as arr:
            arrival_cost(eng, bs, ns, 0.0, 1)
        text += (
            f"\n{ns.arrivals} arrivals of {ns.arrival_len} tokens, one every "
            f"{ns.arrival_every} steps (the steps between them included)\n\n"
        )
        text += arr.table(ns.arrivals, "arrival")
    os.makedirs(ns.output_dir, exist_ok=True)
    with open(os.path.join(ns.output_dir, f"sections_{name}_bs{bs}{ns.tag}.md"), "w") as f:
        f.write(text)
    print(text)


def section_targets() -> dict[str, tuple[object, str]]:
    """The engine's and scheduler's step phases, then the worker's (worker/sections.py),
    that `--time-sections` times (SectionTimes)."""
    from gyrfalcon.scheduler.scheduler import Scheduler

    return {
        "engine step": (LocalEngine, "step"),
        "scheduler build_plan": (Scheduler, "build_plan"),
        "scheduler process_result": (Scheduler, "process_result"),
    } | worker_sections()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("draft")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="prefill backend of both engines (triton: no flashinfer module to build on a "
        "fresh machine; the steps measured are decode and verify steps either way)",
    )
    p.add_argument(
        "--disable-pdl", action="store_true",
        help="no programmatic dependent launch: the kernel profile's durations then do not "
        "overlap (each kernel waits for the previous one to end)",
    )  # fmt: skip
    p.add_argument("--num-steps", type=int, default=3, help="k")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument(
        "--arrival-len", type=int, default=0,
        help="also measure a request of this many prompt tokens arriving into the batch",
    )  # fmt: skip
    p.add_argument("--arrival-every", type=int, default=12, help="steps between arrivals")
    p.add_argument(
        "--separate-prefill-steps", action="store_true",
        help="both engines plan an arriving prompt in a step of its own (the server flag)",
    )  # fmt: skip
    p.add_argument("--arrivals", type=int, default=12)
    p.add_argument(
        "--time-sections", action="store_true",
        help="also time the worker's step phases (host wall time, no profiler) over the "
        "first batch size's steady steps and its arrivals; tables beside the results",
    )  # fmt: skip
    p.add_argument(
        "--no-freeze-heap", action="store_true",
        help="leave each engine's start-up heap in the collector's generations (a serving "
        "worker freezes it once ready: gc_heap.freeze_startup_heap)",
    )  # fmt: skip
    p.add_argument("--device-kind", default="unknown")
    p.add_argument("--output-dir", default="benchmarks/results")
    p.add_argument("--tag", default="")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="also run each engine's steps at the first batch size under cProfile and write "
        "the host functions by own time there (where the host time of a step goes)",
    )
    ns = p.parse_args(argv)
    sizes = [int(s) for s in ns.batch_sizes.split(",")]
    common = dict(
        model=ns.model, device=ns.device, dtype=ns.dtype, load_format=ns.load_format,
        attention_backend=ns.attention_backend,
        kv_cache_memory=ns.kv_cache_memory, max_num_seqs=max(sizes), disable_pdl=ns.disable_pdl,
        cuda_graph_max_bs=max(sizes), separate_prefill_steps=ns.separate_prefill_steps,
    )  # fmt: skip
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=ns.draft,
        speculative_num_steps=ns.num_steps,
    )
    rows = []
    results, arrivals = {}, {}
    for name, extra in (("plain", {}), ("spec", spec)):
        # NOTE: no page-allocator check after every step (the server's default)
        eng = LocalEngine(ServerArgs(**common, **extra), ns.model, check_invariants=False)
        if not ns.no_freeze_heap:
            freeze_startup_heap()  # NOTE: as a worker does once it serves
        pauses = GcPauses().install()
        results[name] = {bs: step_times(eng, bs, ns.prompt_len, ns.steps, bs) for bs in sizes}
        pauses.uninstall()
        print(f"{name} engine, steady steps: {pauses.summary()}")
        if ns.arrival_len:
            arrivals[name] = {
                bs: arrival_cost(eng, bs, ns, results[name][bs][0], bs) for bs in sizes
            }
        if ns.time_sections:
            time_sections(eng, sizes[0], ns, name)
        if ns.profile_dir:
            profile(eng, sizes[0], ns, os.path.join(ns.profile_dir, f"host_{name}.txt"))
            if ns.arrival_len:
                with host_profile(os.path.join(ns.profile_dir, f"host_{name}_arrivals.txt")):
                    arrival_cost(eng, sizes[0], ns, results[name][sizes[0]][0], 0)
        gc.unfreeze()  # NOTE: the engine's cycles are garbage from here on
        del eng
        gc.collect()
        if ns.device == "cuda":
            torch.cuda.empty_cache()
    for bs in sizes:
        (tp, ep), (ts, es) = results["plain"][bs], results["spec"][bs]
        rows.append(
            dict(batch_size=bs, plain_step_ms=tp * 1e3, spec_step_ms=ts * 1e3,
                 ratio=ts / tp, plain_tokens_per_step=ep, spec_tokens_per_step=es)
        )  # fmt: skip
        if arrivals:
            rows[-1].update(
                plain_arrival_ms=arrivals["plain"][bs] * 1e3,
                spec_arrival_ms=arrivals["spec"][bs] * 1e3,
            )
    name = f"spec_step_{Path(ns.model).name}{ns.tag}_k{ns.num_steps}_{ns.device_kind}"
    report = dict(
        bench="spec_step", model=ns.model, draft=ns.draft, load_format=ns.load_format,
        k=ns.num_steps, prompt_len=ns.prompt_len, arrival_len=ns.arrival_len,
        arrival_every=ns.arrival_every, separate_prefill_steps=ns.separate_prefill_steps,
        frozen_heap=not ns.no_freeze_heap, device_kind=ns.device_kind,
        commit=os.environ.get("GYRFALCON_COMMIT") or git_commit(), rows=rows,
    )  # fmt: skip
    os.makedirs(ns.output_dir, exist_ok=True)
    with open(os.path.join(ns.output_dir, name + ".json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = [
        f"Spec step cost, {Path(ns.model).name} ({ns.load_format}), k={ns.num_steps}, "
        f"prompt {ns.prompt_len}, {ns.device_kind}, commit {report['commit']}",
        "",
        "| batch | plain step ms | spec step ms | ratio | tokens/step (spec) |"
        + (" plain arrival ms | spec arrival ms |" if arrivals else ""),
        "| ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if arrivals else ""),
    ]
    for r in rows:
        line = (
            f"| {r['batch_size']} | {r['plain_step_ms']:.3f} | {r['spec_step_ms']:.3f} | "
            f"{r['ratio']:.2f}x | {r['spec_tokens_per_step']:.2f} |"
        )
        if arrivals:
            line += f" {r['plain_arrival_ms']:.2f} | {r['spec_arrival_ms']:.2f} |"
        lines.append(line)
    if arrivals:
        lines += [
            "",
            f"Arrival: a {ns.arrival_len}-token prompt joining the batch (module docstring).",
        ]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(ns.output_dir, name + ".md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
