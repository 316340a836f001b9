#!/usr/bin/env python3
"""Decode step latency and tokens/s of the model runner, against the bandwidth roofline.

The runner is built once (``worker.bootstrap.build_worker``, as the server does)
with KV pages for the largest batch. Per batch size: random prompts of
--context tokens are prefilled (plans of at most --prefill-tokens tokens),
--warmup decode steps run, then --steps decode steps are timed as the server
runs them (`step_ms`): each step is submitted before the previous one's tokens
are read, its inputs filled on the device from them. Then --steps more are timed
one by one with the device synchronized around each (`step_ms_sync`, what a
step costs with no overlap). The requests are then freed. Plans are hand-built,
so scheduler time is not counted; metadata, forward, sampling and the copy of
sampled ids to the host are.
Roofline: (weight bytes + KV bytes at the mean KV length of the timed steps) /
the bandwidth measured in this run (or --bandwidth). Unknown flags go to
ServerArgs (``gyrfalcon serve --help``), e.g. ``--page-size 32 --enforce-eager``.

    python benchmarks/bench_decode.py --model benchmarks/models/llama-3.1-8b \\
        --load-format dummy --device-kind h100 --output-json decode_llama.json
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench.bandwidth import measure_read_bandwidth
from gyrfalcon.bench.decode_driver import Driver, sync
from gyrfalcon.bench.device_timeline import format_summary, split_by_launch, summarize
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.bench.roofline import kv_read_bytes, roofline_step_ms, tokens_per_s, weight_bytes
from gyrfalcon.config.cli_args import parse_size
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.loader.resolve import default_model_name, resolve_model
from gyrfalcon.profiling import host_profile
from gyrfalcon.worker.bootstrap import build_worker


def bench_batch(
    driver: Driver, ns: argparse.Namespace, batch_size: int, vocab: int, gen: torch.Generator
) -> dict[str, float]:
    """Prefill `batch_size` prompts, warm up, time `steps` decode steps, free them."""
    device = driver.runner.device
    prompts = torch.randint(0, vocab, (batch_size, ns.context), generator=gen).tolist()
    try:
        sync(device)
        t0 = time.perf_counter()
        driver.prefill(prompts, ns.prefill_tokens)
        sync(device)
        prefill_s = time.perf_counter() - t0
        driver.decode_overlapped(ns.warmup)
        graphs = driver.runner.executor.graphs
        runs0 = graphs.num_runs if graphs is not None else 0
        sync(device)
        t0 = time.perf_counter()
        driver.decode_overlapped(ns.steps)
        sync(device)
        overlapped_s = time.perf_counter() - t0
        graph_steps = (graphs.num_runs if graphs is not None else 0) - runs0
        times = []
        for _ in range(ns.steps):
            sync(device)
            t0 = time.perf_counter()
            driver.decode()
            sync(device)
            times.append(time.perf_counter() - t0)
        if ns.profile_dir:
            profile_host(driver, ns, batch_size)
    finally:
        driver.release()
    return {
        "prefill_s": prefill_s,
        "step_ms": 1e3 * overlapped_s / ns.steps,
        "graph_steps": graph_steps,  # timed steps that replayed a graph
        "step_ms_sync": 1e3 * sum(times) / len(times),
        "step_ms_sync_median": 1e3 * statistics.median(times),
        "step_ms_sync_min": 1e3 * min(times),
    }


def profile_host(driver: Driver, ns: argparse.Namespace, batch_size: int) -> None:
    """cProfile of --steps overlapped decode steps: where the host's time goes."""
    path = os.path.join(ns.profile_dir, f"host_profile_bs{batch_size}.txt")
    with host_profile(path, f"{ns.steps} overlapped decode steps at batch {batch_size}"):
        driver.decode_overlapped(ns.steps)
        sync(driver.runner.device)
    if driver.runner.device.type != "cuda":
        return
    # the device side: kernels of 8 overlapped steps, by total time
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
        driver.decode_overlapped(8)
        sync(driver.runner.device)
    table = kprof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
    )
    with open(os.path.join(ns.profile_dir, f"kernels_bs{batch_size}.txt"), "w") as f:
        f.write(f"8 overlapped decode steps at batch {batch_size}\n{table}\n")
    # each graph launch's span and where it goes (bench/device_timeline.py)
    trace_path = os.path.join(ns.profile_dir, f"trace_bs{batch_size}.json")
    kprof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        launches, other = split_by_launch(json.load(f))
    os.remove(trace_path)  # NOTE: megabytes; the summary is what is kept
    if len(launches) > 2:  # NOTE: eager steps (a size no graph serves) launch none
        with open(os.path.join(ns.profile_dir, f"device_timeline_bs{batch_size}.txt"), "w") as f:
            f.write(f"8 overlapped decode steps at batch {batch_size}\n")
            f.write(format_summary(summarize(launches, other)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag is a ServerArgs flag (see `gyrfalcon serve --help`).",
    )
    ap.add_argument("--model", default=None, help="HF dir (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N")
    ap.add_argument("--device-kind", default="unknown", help="label recorded in the JSON")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="token cap of a plan")
    ap.add_argument("--bandwidth", type=float, default=None, help="B/s; skips measuring it")
    ap.add_argument("--bandwidth-bytes", default=None, help="buffer of the bandwidth probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shuffle-pages",
        action="store_true",
        help="hand KV pages out in random order, as a long-running server's are",
    )
    ap.add_argument("--output-json", default=None)
    ap.add_argument(
        "--profile-dir",
        default=None,
        help="write a host cProfile per batch size; on CUDA also the kernels of 8 steps and "
        "their graph launches' device timeline (bench/device_timeline.py)",
    )
    return ap


def server_args(ns: argparse.Namespace, extra: list[str], model_dir: str) -> ServerArgs:
    """ServerArgs from the ServerArgs flags in `extra`, overlaid with this script's flags."""
    sp = argparse.ArgumentParser(prog="bench_decode.py (ServerArgs flags)", add_help=False)
    ServerArgs.add_cli_args(sp)
    sns = sp.parse_args(extra)
    if sns.model is not None:
        sp.error(f"unexpected argument {sns.model!r} (use --model)")
    base = ServerArgs.from_cli_args(sns)
    return dataclasses.replace(
        base,
        model=model_dir,
        load_format=ns.load_format,
        dtype=ns.dtype,
        attention_backend=ns.attention_backend,
        device=ns.device,
        seed=ns.seed,
    ).resolved(ModelConfig.from_dir(model_dir))


def print_table(rows: list[dict]) -> None:
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s':>10} {'roof ms':>9} {'%roof':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch_size']:>6} {r['context']:>8}  {r['error']}")
            continue
        pct = 100 * r["roofline_step_ms"] / r["step_ms"]
        print(
            f"{r['batch_size']:>6} {r['context']:>8} {r['step_ms']:>9.3f} {r['tok_s']:>10.1f} "
            f"{r['roofline_step_ms']:>9.3f} {pct:>5.1f}%"
        )


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns, extra = ap.parse_known_args(argv)
    batch_sizes = [int(x) for x in ns.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or ns.context < 1 or ns.steps < 1 or ns.prefill_tokens < 1:
        ap.error("batch sizes, --context, --steps and --prefill-tokens must be >= 1")
    model_dir = resolve_model(ns.model)
    has_weights = glob.glob(os.path.join(model_dir, "*.safetensors"))
    if ns.load_format != "dummy" and not has_weights:
        ap.error(f"{model_dir} has no weights; pass --load-format dummy")
    cfg = ModelConfig.from_dir(model_dir)
    profiled = ns.steps + 8 if ns.profile_dir else 0  # host profile, then kernel profile
    span = ns.context + ns.warmup + 2 * ns.steps + profiled  # KV length after the last step
    if span > cfg.max_position_embeddings:
        ap.error(
            f"context + warmup + steps = {span} exceeds the model's {cfg.max_position_embeddings}"
        )
    args = server_args(ns, extra, model_dir)
    pages_per_seq = -(-span // args.page_size)
    need_pages = 1 + max(batch_sizes) * pages_per_seq
    if args.num_kv_pages is None:
        args = dataclasses.replace(args, num_kv_pages=need_pages)
    elif args.num_kv_pages < need_pages:
        ap.error(f"--num-kv-pages {args.num_kv_pages} < {need_pages} needed")
    if args.max_model_len is not None and args.max_model_len < span:
        ap.error(f"--max-model-len {args.max_model_len} < context + warmup + steps = {span}")
    args = dataclasses.replace(
        args,
        max_model_len=args.max_model_len or span,  # graph buffers sized for what runs
        max_num_seqs=max(args.max_num_seqs, max(batch_sizes)),
    )
    device = torch.device(args.device)

    if ns.bandwidth is not None:
        bandwidth, bw_source = ns.bandwidth, "given"
    else:
        probe = ns.bandwidth_bytes or ("1GiB" if device.type == "cuda" else "256MiB")
        bandwidth, bw_source = measure_read_bandwidth(device, parse_size(probe)), "measured"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s ({bw_source})", flush=True)

    runner = build_worker(args, model_dir, cfg, rank=0)[0]
    graphs = runner.executor.graphs
    dtype_bytes = torch.empty((), dtype=runner.executor.dtype).element_size()
    wbytes = weight_bytes(cfg, dtype_bytes)
    driver = Driver(
        runner, args.page_size, args.num_kv_pages, ns.seed if ns.shuffle_pages else None
    )
    gen = torch.Generator().manual_seed(ns.seed)
    mean_kv = ns.context + ns.warmup + (ns.steps + 1) / 2  # KV read by the mean overlapped step
    rows: list[dict] = []
    for bs in batch_sizes:
        row: dict = {"batch_size": bs, "context": ns.context}
        try:
            t = bench_batch(driver, ns, bs, cfg.vocab_size, gen)
        except torch.OutOfMemoryError as exc:  # record it and go on with the other sizes
            torch.cuda.empty_cache()
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
            rows.append(row)
            print(f"batch {bs}: {row['error']}", flush=True)
            continue
        kv = kv_read_bytes(cfg, bs, 1, runner.executor.kv_cache.k.element_size()) * mean_kv
        roof = roofline_step_ms(wbytes, kv, bandwidth)
        row.update(t)
        row.update(
            tok_s=tokens_per_s(bs, t["step_ms"]),
            roofline_step_ms=roof,
            roofline_tok_s=tokens_per_s(bs, roof),
            mean_kv_len=mean_kv,
            kv_read_bytes=kv,
        )
        rows.append(row)
        print(f"batch {bs}: {t['step_ms']:.3f} ms/step, {row['tok_s']:.1f} tok/s", flush=True)

    result = {
        "bench": "decode",
        "device_kind": ns.device_kind,
        "model": default_model_name(ns.model),
        "model_dir": model_dir,
        "commit": git_commit(),
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "decode_attention_backend": args.decode_attention_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "shuffled_pages": ns.shuffle_pages,
        "enable_pdl": not args.disable_pdl,
        "load_format": args.load_format,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "graph_mode": graphs.mode if graphs is not None else "eager",
        "graph_batch_sizes": graphs.sizes if graphs is not None else [],
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": bw_source,
        "weight_bytes": wbytes,
        "context": ns.context,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "server_args": dataclasses.asdict(args),
        "rows": rows,
    }
    if ns.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
