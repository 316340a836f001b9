"""Serving load generator: ``gyrfalcon bench serve`` / ``benchmarks/bench_serving.py``.

Sends a workload (see :mod:`gyrfalcon.bench.datasets`) to an OpenAI-compatible
server as streamed requests with Poisson arrivals and an optional concurrency
cap, then reports throughput and latency figures (see
:mod:`gyrfalcon.bench.metrics`) as a table and optionally as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from gyrfalcon.bench import report_json
from gyrfalcon.bench.client import ENDPOINT_PATHS, build_payload, fetch_model_ids, send_request
from gyrfalcon.bench.datasets import (
    SampleRequest,
    TokenizerLike,
    arrival_offsets,
    load_jsonl_requests,
    sample_random_requests,
)
from gyrfalcon.bench.metrics import RequestResult, format_table, per_request_lists, summarize
from gyrfalcon.bench.plot import plot_run
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.bench.serving_args import DEFAULTS, build_parser


def base_url_of(args: argparse.Namespace) -> str:
    """The server root URL, without a trailing slash."""
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def load_tokenizer(args: argparse.Namespace, needed: bool) -> TokenizerLike | None:
    """Load ``--tokenizer`` (or a local ``--model`` dir when ``needed``); else None."""
    name = args.tokenizer
    if name is None and needed and args.model and os.path.isdir(args.model):
        name = args.model
    if name is None:
        if needed:
            raise ValueError("text prompts need a tokenizer: pass --tokenizer")
        return None
    from transformers import AutoTokenizer  # NOTE: lazy, the default path needs none

    return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)


def build_workload(args: argparse.Namespace) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """The requests of the run, as chosen by the workload flags, and the warm-up's
    (`--warmup-requests`). The warm-up's prompts are drawn beside the run's (random
    prompts; a jsonl file's lines past the run's): a server that caches prefixes would
    otherwise find a timed prompt already computed. A file with no lines to spare lends
    the run's first prompts."""
    num_warm = max(args.warmup_requests, 0)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        tokenizer = load_tokenizer(args, needed=False)
        wanted = None if args.num_prompts is None else args.num_prompts + num_warm
        got = load_jsonl_requests(args.dataset_path, args.jsonl_output_len, wanted, tokenizer)
        num = len(got) if args.num_prompts is None else min(args.num_prompts, len(got))
        lend = got[num:] or got
        return got[:num], [lend[i % len(lend)] for i in range(num_warm)]
    fmt = args.random_prompt_format or ("text" if args.endpoint == "chat" else "ids")
    tokenizer = load_tokenizer(args, needed=fmt == "text")
    token_range = args.random_token_range
    if token_range is None and tokenizer is None:
        token_range = DEFAULTS.random_token_range
    num = args.num_prompts or DEFAULTS.num_random_prompts
    got = sample_random_requests(
        num_prompts=num + num_warm,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
        token_range=tuple(token_range) if token_range else None,
        tokenizer=tokenizer,
        as_text=fmt == "text",
    )
    return got[:num], got[num:]


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    samples: Sequence[SampleRequest],
    payloads: Sequence[dict[str, Any]],
    offsets: np.ndarray,
    max_concurrency: int | None,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send each payload at its arrival offset; return results and wall time."""
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(payloads), disable=not show_progress)

    async def one(sample: SampleRequest, payload: dict[str, Any]) -> RequestResult:
        if limiter is None:
            result = await send_request(session, url, payload, sample.prompt_len)
        else:
            async with limiter:
                result = await send_request(session, url, payload, sample.prompt_len)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    for sample, payload, offset in zip(samples, payloads, offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(sample, payload)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.close()
    return results, duration


def _jsonable(value: Any) -> Any:
    """Args as strict JSON: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


async def benchmark(
    args: argparse.Namespace, samples: list[SampleRequest], warm_samples: list[SampleRequest]
) -> int:
    """Resolve the model, warm up with `warm_samples`, run the timed load and report it."""
    base_url = base_url_of(args)
    url = base_url + ENDPOINT_PATHS[args.endpoint]
    percentiles = [float(q) for q in args.percentiles.split(",") if q.strip()]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        model = args.model
        if model is None:
            ids = await fetch_model_ids(session, base_url)
            if not ids:
                raise RuntimeError(f"{base_url}/v1/models lists no model")
            model = ids[0]
        payloads = [
            build_payload(args.endpoint, model, s, args.ignore_eos, args.extra_body)
            for s in samples
        ]
        if warm_samples:
            warm = [
                build_payload(args.endpoint, model, s, args.ignore_eos, args.extra_body)
                for s in warm_samples
            ]
            warm_results = await asyncio.gather(*(send_request(session, url, w) for w in warm))
            bad = [r.error for r in warm_results if not r.success]
            print(
                f"Warmup: {len(warm) - len(bad)}/{len(warm)} requests succeeded"
                + (f" (first error: {bad[0]})" if bad else "")
            )
        rng = np.random.default_rng([args.seed, 1])  # NOTE: independent of the dataset stream
        offsets = arrival_offsets(len(samples), args.request_rate, rng)
        print(
            f"Benchmarking {model} at {url}: {len(samples)} requests, "
            f"rate {args.request_rate} req/s, max concurrency {args.max_concurrency}"
        )
        results, duration = await run_requests(
            session,
            url,
            samples,
            payloads,
            offsets,
            args.max_concurrency,
            show_progress=not args.disable_tqdm,
        )
    summary = summarize(results, duration, percentiles)
    errors = list(dict.fromkeys(r.error for r in results if not r.success))
    print(format_table(summary, percentiles, errors[: DEFAULTS.shown_errors]))
    if args.output_json:
        report = {
            "bench": "serving",
            "device_kind": args.device_kind,
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model": model,
            "num_prompts": len(samples),
            "args": _jsonable(vars(args)),
            "summary": summary,
            "per_request": per_request_lists(results),
        }
        report_json.write(args.output_json, report)
        print(f"Wrote {args.output_json}")
    if args.plot:
        plot_run(results, args.plot, f"{model}, {args.endpoint}, {len(samples)} requests")
        print(f"Wrote {args.plot}")
    return 0 if summary["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the benchmark, return an exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        parser.error("--request-rate must be > 0 (inf for all at once)")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or gyrfalcon[bench])")
    if args.endpoint == "chat" and args.random_prompt_format == "ids" and args.dataset == "random":
        parser.error("the chat endpoint needs text prompts: use --random-prompt-format text")
    try:
        samples, warm_samples = build_workload(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.endpoint == "chat" and any(not isinstance(s.prompt, str) for s in samples):
        print("error: the chat endpoint needs text prompts, not token ids", file=sys.stderr)
        return 2
    try:
        return asyncio.run(benchmark(args, samples, warm_samples))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
