"""Command line of `gyrfalcon bench serve`: defaults and the argument parser."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from gyrfalcon.bench.client import ENDPOINT_PATHS


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
        help="JSON object merged into every request body (requests are greedy unless it says "
        "otherwise), e.g. '{\"temperature\": 1.0}'",
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
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw latency CDFs and throughput over time (needs matplotlib: pip install "
        "gyrfalcon[bench])",
    )
    o.add_argument(
        "--device-kind",
        default="unknown",
        help="label of the machine the server runs on, recorded in the JSON (e.g. nvidia-h100-x1)",
    )
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p
