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
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from gyrfalcon.bench.client import ENDPOINT_PATHS, build_payload, fetch_model_ids, send_request
from gyrfalcon.bench.datasets import (
    SampleRequest,
    TokenizerLike,
    arrival_offsets,
    load_jsonl_requests,
    sample_random_requests,
)
from gyrfalcon.bench.metrics import RequestResult, format_table, per_request_lists, summarize


@dataclass(frozen=True)
class BenchDefaults:
    """Every default of the load generator, in one place."""

    host: str = "127.0.0.1"
    port: int = 8000
    num_random_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 1.0
    # NOTE: ids 1000..29999 skip the special tokens that sit at the low or high
    # end of common vocabularies and fit every vocabulary of >= 30k entries.
    random_token_range: tuple[int, int] = (1000, 30000)
    jsonl_output_len: int = 256
    request_rate: float = math.inf
    seed: int = 0
    warmup_requests: int = 1
    percentiles: str = "99"
    request_timeout_s: float = 6 * 3600.0
    shown_errors: int = 5


DEFAULTS = BenchDefaults()


def _git_commit() -> str:
    if os.environ.get("GYRFALCON_COMMIT"):  # a copy of the tree without .git
        return os.environ["GYRFALCON_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gyrfalcon bench serve``."""
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="gyrfalcon bench serve",
        description="Benchmark an OpenAI-compatible server with streamed requests.",
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url",
        default=None,
        help=f"server URL (default: http://HOST:PORT = http://{d.host}:{d.port})",
    )
    t.add_argument("--host", default=d.host, help="server host when --base-url is not given")
    t.add_argument(
        "--port",
        type=int,
        default=d.port,
        help="server port when --base-url is not given (default: %(default)s)",
    )
    t.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_PATHS),
        default="completions",
        help="completions: POST /v1/completions; chat: POST /v1/chat/completions",
    )
    t.add_argument("--model", default=None, help="model name (default: first id of GET /v1/models)")
    t.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir or id; needed for text prompts of the random dataset "
        "(then the default is --model when it is a local directory: nothing is "
        "downloaded), optional for jsonl "
        "(counts prompt tokens when the server reports no usage)",
    )
    t.add_argument("--trust-remote-code", action="store_true", help="passed to the tokenizer")
    t.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="per-request timeout in seconds (default: %(default)s)",
    )
    t.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request body, e.g. '{\"temperature\": 0}'",
    )

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["random", "jsonl"], default="random")
    w.add_argument("--dataset-path", default=None, help="jsonl file for --dataset jsonl")
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (default: {d.num_random_prompts} for random, every line for jsonl)",
    )
    w.add_argument(
        "--random-input-len",
        type=int,
        default=d.random_input_len,
        help="largest prompt length of the random dataset (default: %(default)s)",
    )
    w.add_argument(
        "--random-output-len",
        type=int,
        default=d.random_output_len,
        help="largest output length (max_tokens) of the random dataset (default: %(default)s)",
    )
    w.add_argument(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths are uniform integers in [max(1, round(LEN * RATIO)), LEN]; "
        "1.0 means exactly LEN, 0.0 means 1..LEN (default: %(default)s)",
    )
    w.add_argument(
        "--random-prompt-format",
        choices=["ids", "text"],
        default=None,
        help="ids: send token-id lists (no tokenizer needed); text: decode them with "
        "the tokenizer (default: ids for completions, text for chat)",
    )
    w.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="draw random token ids from [LOW, HIGH) (default: the "
        "tokenizer's non-special ids, or [%d, %d) without one)" % d.random_token_range,
    )
    w.add_argument(
        "--jsonl-output-len",
        type=int,
        default=d.jsonl_output_len,
        help="max_tokens for jsonl lines without output_len/max_tokens (default: %(default)s)",
    )
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=d.request_rate,
        help="requests per second with Poisson arrivals; inf (the default) sends all at once",
    )
    ld.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: unlimited)",
    )
    ld.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the dataset and arrivals (default: %(default)s)",
    )
    ld.add_argument(
        "--warmup-requests",
        type=int,
        default=d.warmup_requests,
        help="requests sent and discarded before timing starts (default: %(default)s)",
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--percentiles",
        default=d.percentiles,
        help="comma-separated percentiles reported besides mean and median (default: %(default)s)",
    )
    o.add_argument("--output-json", default=None, help="write args, summary and per-request data")
    o.add_argument(
        "--device-kind",
        default="unknown",
        help="label of the machine the server runs on, recorded in the JSON (e.g. nvidia-h100-x1)",
    )
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


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


def build_workload(args: argparse.Namespace) -> list[SampleRequest]:
    """The requests of the run, as chosen by the workload flags."""
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        tokenizer = load_tokenizer(args, needed=False)
        return load_jsonl_requests(
            args.dataset_path, args.jsonl_output_len, args.num_prompts, tokenizer
        )
    fmt = args.random_prompt_format or ("text" if args.endpoint == "chat" else "ids")
    tokenizer = load_tokenizer(args, needed=fmt == "text")
    token_range = args.random_token_range
    if token_range is None and tokenizer is None:
        token_range = DEFAULTS.random_token_range
    return sample_random_requests(
        num_prompts=args.num_prompts or DEFAULTS.num_random_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
        token_range=tuple(token_range) if token_range else None,
        tokenizer=tokenizer,
        as_text=fmt == "text",
    )


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


async def benchmark(args: argparse.Namespace, samples: list[SampleRequest]) -> int:
    """Resolve the model, warm up, run the timed load and report it."""
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
        if args.warmup_requests > 0:
            warm = [payloads[i % len(payloads)] for i in range(args.warmup_requests)]
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
            "commit": _git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model": model,
            "num_prompts": len(samples),
            "args": _jsonable(vars(args)),
            "summary": summary,
            "per_request": per_request_lists(results),
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, allow_nan=False)
        print(f"Wrote {args.output_json}")
    return 0 if summary["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the benchmark, return an exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        parser.error("--request-rate must be > 0 (inf for all at once)")
    if args.endpoint == "chat" and args.random_prompt_format == "ids" and args.dataset == "random":
        parser.error("the chat endpoint needs text prompts: use --random-prompt-format text")
    try:
        samples = build_workload(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.endpoint == "chat" and any(not isinstance(s.prompt, str) for s in samples):
        print("error: the chat endpoint needs text prompts, not token ids", file=sys.stderr)
        return 2
    try:
        return asyncio.run(benchmark(args, samples))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
