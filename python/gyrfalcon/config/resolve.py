"""`ServerArgs.resolved()`: every "auto" of the parsed arguments resolved for this
machine (device, dtype, attention backends, the scheduler's token budgets, host
threads) and the parallel and speculative settings checked, once, at parse time
(with the model's config: its split over the ranks and the drafter against the
target too, before any process starts). Kept apart from the flags' declarations
(`server_args.py`)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from gyrfalcon.config.attention import FLASHINFER_HEAD_DIMS, default_attention_backend
from gyrfalcon.config.cli_args import available_cores, parse_size
from gyrfalcon.config.nodes import init_url
from gyrfalcon.config.piecewise import DEFAULT_MAX_TOKENS, launch_bound_at
from gyrfalcon.config.sharding import check_parallel_fit
from gyrfalcon.config.speculative import resolve_speculative

if TYPE_CHECKING:
    from gyrfalcon.config.model_config import ModelConfig
    from gyrfalcon.config.server_args import ServerArgs


def resolve_server_args(args: ServerArgs, model: ModelConfig | None = None) -> ServerArgs:
    """A copy of args with every "auto" resolved for this machine (and, when the
    model's config is given, for that model: its attention, its graphs); ValueError
    names a flag that cannot work."""
    check_limits(args, model)
    device = args.device
    if device == "auto":  # NOTE: torch only here: the launcher imports it after the spawn
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    # NOTE: measured on nvidia-h200 (benchmarks/NOTES.md): 8192/16384 gives +11% output
    # throughput on SGLang's serving check over 2048/8192.
    on_gpu = device.startswith("cuda")
    budget = args.max_num_batched_tokens or (16384 if on_gpu else 8192)
    chunk = args.chunked_prefill_size or (8192 if on_gpu else 2048)
    if chunk == -1:  # NOTE: SGLang's "no chunking": a prompt takes a whole step's budget
        chunk = budget
    largest = min(budget, chunk + args.max_num_seqs)  # a prompt chunk beside every row
    # NOTE: a model launch-bound up to its largest step gets graphs up to it, and triton,
    # whose graphs take a whole step (config/piecewise.py, config/attention.py)
    launch_bound = launch_bound_at(model, largest, on_gpu)
    piecewise = args.piecewise_cuda_graph_max_tokens
    if piecewise is None:
        piecewise = largest if launch_bound else DEFAULT_MAX_TOKENS
    backend = args.attention_backend
    fp8_kv = args.kv_cache_dtype == "fp8_e4m3"
    if backend == "auto":
        whole = launch_bound and piecewise >= largest
        backend = default_attention_backend(device, dtype, model and model.head_dim, whole)
        if fp8_kv and backend == "flashinfer":
            backend = "triton"  # NOTE: our flashinfer path reads 16-bit caches only
    decode_backend = args.decode_attention_backend
    if decode_backend == "auto":
        decode_backend = "triton" if backend == "flashinfer" else backend
    if fp8_kv and "flashinfer" in (backend, decode_backend):
        raise ValueError(
            "--kv-cache-dtype fp8_e4m3 runs on the triton or torch_ref attention backends"
        )
    if "flashinfer" in (backend, decode_backend):
        if not on_gpu:
            raise ValueError("the flashinfer attention backend runs on CUDA only")
        if model is not None and model.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"flashinfer has no kernels for head_dim {model.head_dim}; "
                "use --attention-backend triton"
            )
    # NOTE: on CUDA the worker's host threads matter little: its tensor math on the
    # host is converting checkpoint dtypes at load (threads help there), and small
    # metadata tensors stay under torch's grain size and never wake the pool; so
    # torch's default stays (None), its idle threads asleep (OMP_WAIT_POLICY).
    threads = args.cpu_threads
    if threads is None and not on_gpu:
        threads = available_cores()
    if threads is not None and threads < 1:
        raise ValueError(f"--cpu-threads must be at least 1, got {threads}")
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {args.dp_size}")
    world = args.tp_size * args.dp_size
    if args.ep_size not in (1, args.tp_size, world):
        raise ValueError(
            f"--ep-size {args.ep_size} must be 1 (MoE-TP), the tp size {args.tp_size} "
            f"or tp x dp = {world} (DP attention)"
        )
    if args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    if model is not None:  # NOTE: before, a worker found it after every process started
        check_parallel_fit(model, args.tp_size, args.dp_size, args.ep_size)
    steps, verified = resolve_speculative(
        args.speculative_algorithm,
        args.speculative_draft_model_path,
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )
    if steps is not None and model is not None:
        assert args.speculative_draft_model_path is not None  # NOTE: resolve_speculative
        check_drafter(model, args.speculative_draft_model_path, args.tp_size)
    init_addr = args.dist_init_addr and init_url(args.dist_init_addr)
    return dataclasses.replace(
        args,
        dist_init_addr=init_addr,
        api_server_count=args.num_api_servers,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=verified,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        decode_attention_backend=decode_backend,
        max_num_batched_tokens=budget,
        chunked_prefill_size=chunk,
        piecewise_cuda_graph_max_tokens=piecewise,
        cpu_threads=threads,
    )


def check_limits(args: ServerArgs, model: ModelConfig | None) -> None:
    """ValueError naming the first flag whose value no server can run with (a request
    would hang, a worker would fail after the launch, or every request would be
    refused), and --max-model-len beyond the model's positions when its config is given."""
    at_least = {
        "--page-size": (args.page_size, 1),
        "--num-kv-pages": (args.num_kv_pages, 2),  # NOTE: the dummy page and one more
        "--max-num-seqs": (args.max_num_seqs, 1),
        "--max-queue-len": (args.max_queue_len, 0),
        "--max-model-len": (args.max_model_len, 1),
        "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
        "--cuda-graph-max-bs": (args.cuda_graph_max_bs, 1),
        "--piecewise-cuda-graph-max-tokens": (args.piecewise_cuda_graph_max_tokens, 0),
    }
    for flag, (value, least) in at_least.items():
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    chunk = args.chunked_prefill_size
    if chunk is not None and chunk < 1 and chunk != -1:
        raise ValueError(
            f"--chunked-prefill-size must be at least 1 (or -1: no chunking), got {chunk}"
        )
    if not 0 < args.mem_fraction <= 1:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    for flag, value in (("--schedule-conservativeness", args.schedule_conservativeness),
                        ("--log-stats-interval", args.log_stats_interval)):  # fmt: skip
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    for flag, size in (("--kv-cache-memory", args.kv_cache_memory),
                       ("--max-cpu-kv-memory", args.max_cpu_kv_memory)):  # fmt: skip
        if size is None:
            continue
        try:
            parse_size(size)
        except ValueError:
            raise ValueError(f"{flag} takes a size like 2GiB or 512MiB, not {size!r}") from None
    if args.cuda_graph_bs:
        try:
            sizes_ok = min(args.graph_batch_sizes() or [0]) >= 1
        except ValueError:  # NOTE: a size that is not an integer
            sizes_ok = False
        if not sizes_ok:
            raise ValueError(
                f"--cuda-graph-bs takes batch sizes >= 1 like 1,2,4,8, not {args.cuda_graph_bs!r}"
            )
    positions = model and model.max_position_embeddings
    if positions and args.max_model_len is not None and args.max_model_len > positions:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the model's {positions} "
            "positions (max_position_embeddings)"
        )


def check_drafter(target: ModelConfig, path: str, tp_size: int) -> None:
    """ValueError if the drafter at `path` cannot serve `target`, from the two configs
    alone (`check_draft_config`), or does not split over `tp_size` ranks (every TP rank
    runs it, split like the target's attention and MLP): a mismatch is reported before
    any process starts or any weight loads. The worker checks the drafter's tensors
    when it loads them."""
    from gyrfalcon.config.draft_config import DraftConfig, check_draft_config

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--speculative-draft-model-path {path}: no config.json there")
    draft = DraftConfig.from_dir(path)
    check_draft_config(target, draft)
    try:
        check_parallel_fit(draft.layer, tp_size, 1, 1)
    except ValueError as e:
        raise ValueError(f"--speculative-draft-model-path {path}: {e}") from None
