"""Server arguments: one frozen dataclass; the CLI is generated from its fields.

Every default lives here (STYLE.md rule 19). "auto" values are resolved once,
at parse time, by `ServerArgs.resolved()`; nothing mutates a built instance.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gyrfalcon.config.cli_args import add_dataclass_args
from gyrfalcon.config.nodes import check_nodes
from gyrfalcon.config.resolve import resolve_server_args

if TYPE_CHECKING:
    import torch

    from gyrfalcon.config.model_config import ModelConfig


DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = field(
        default=None,
        metadata={
            "help": "HF model directory or id, a .gguf file, or nothing for the embedded "
            "SmolLM2-135M-Instruct",
            "positional": True,
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    api_server_count: int | None = field(
        default=None,
        metadata={
            "help": "HTTP frontend processes serving --port together (SO_REUSEPORT), each "
            "detokenizing and streaming its own requests on its own core; one scheduler "
            "serves them all (vLLM's flag name and default: one per DP rank, --dp-size)"
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name reported by /v1/models (default: derived)"}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer dir (default: model)"})
    api_key: str | None = field(
        default=None,
        repr=False,  # NOTE: never in a log line
        metadata={
            "help": "require `Authorization: Bearer KEY` on every route but /health, "
            "/version and /metrics (default: $GYRFALCON_API_KEY; neither set: no auth)"
        },
    )
    dtype: DType = field(
        default="auto",
        metadata={
            "help": "weight/activation dtype; auto = bfloat16 on CUDA, float32 on CPU",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads of the worker (overrides OMP_NUM_THREADS there); default: "
            "on CPU the cores this process may run on (its CPU affinity), on CUDA torch's own "
            "default. The frontend and scheduler always use one"
        },
    )
    load_format: str = field(
        default="auto",
        metadata={
            "help": "auto|safetensors|gguf|dummy",
            "choices": ["auto", "safetensors", "gguf", "dummy"],
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto = flashinfer on CUDA when importable (bf16/fp16), else triton on "
            "CUDA, else torch_ref; triton for a model launch-bound up to its largest step "
            "(whole-step graphs; config/attention.py)",
            "choices": ["auto", "torch_ref", "triton", "flashinfer"],
        },
    )
    decode_attention_backend: str = field(
        default="auto",
        metadata={
            "help": "backend of all-decode batches (CUDA-graph replays included); auto = "
            "triton where --attention-backend is flashinfer (faster decode kernels, "
            "benchmarks/bench_attention.py), else the same as --attention-backend",
            "choices": ["auto", "torch_ref", "triton", "flashinfer"],
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV cache element type: auto = the model dtype; fp8_e4m3 halves KV memory "
            "and decode KV reads (values saturate at +-448, no scaling; Triton/torch_ref "
            "attention)",
            "choices": ["auto", "fp8_e4m3"],
        },
    )
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    num_kv_pages: int | None = field(
        default=None, metadata={"help": "KV pages (overrides memory-based sizing)"}
    )
    kv_cache_memory: str | None = field(
        default=None,
        metadata={"help": "KV cache size, e.g. 2GiB or 512MiB (overrides --mem-fraction)"},
    )
    mem_fraction: float = field(
        default=0.85,
        metadata={
            "help": "fraction of device memory for weights+KV (on CPU: of available RAM, "
            "capped by --max-cpu-kv-memory)"
        },
    )
    max_cpu_kv_memory: str = field(
        default="1GiB", metadata={"help": "cap on automatic KV sizing when running on CPU"}
    )
    max_num_seqs: int = field(default=256, metadata={"help": "max requests running at once"})
    max_queue_len: int | None = field(
        default=None,
        metadata={
            "help": "waiting requests beyond which new ones get 503 with Retry-After "
            "(default: no limit)"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (default: the model's)"}
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "tokens per scheduler step (default: 16384 on CUDA, 8192 on CPU)"},
    )
    chunked_prefill_size: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens per step (default: 8192 on CUDA, 2048 on CPU; -1: no "
            "chunking, a prompt may take a whole step's --max-num-batched-tokens)"
        },
    )
    schedule_conservativeness: float = field(
        default=1.0,
        metadata={
            "help": "scales the KV kept free at admission for output still to come "
            "(0: admit whenever the prompt fits; higher: fewer preemptions, smaller batches)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "never use CUDA graphs for decode"}
    )
    cuda_graph_max_bs: int = field(
        default=256, metadata={"help": "largest decode batch run through a CUDA graph"}
    )
    piecewise_cuda_graph_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "largest forward (prefill chunks, mixed steps) run as piecewise CUDA "
            "graphs (0: none; default: the chunk + --max-num-seqs on a GPU for a model "
            "launch-bound that far, e.g. SmolLM2-135M, else 512: config/piecewise.py)"
        },
    )
    cuda_graph_bs: str | None = field(
        default=None,
        metadata={"help": "comma-separated decode batch sizes to capture (default: 1,2,4,8,16,..)"},
    )
    disable_pdl: bool = field(
        default=False,
        metadata={
            "help": "launch the Triton kernels without programmatic dependent launch (by "
            "default on Hopper and later, each may start while the previous one ends)"
        },
    )
    static_graph_replay: bool = field(
        default=False,
        metadata={
            "help": "testing aid: run decode through the graph runner's padded static "
            "buffers eagerly instead of replaying graphs (works on CPU)"
        },
    )
    seed: int = field(default=0, metadata={"help": "global random seed"})
    log_level: str = field(default="info", metadata={"help": "debug|info|warning|error"})
    max_request_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={"help": "larger request bodies get a 400 before they are parsed"},
    )
    request_timeout: float | None = field(
        default=None,
        metadata={
            "help": "seconds a request may take from arrival; then it is aborted and the "
            "client gets a 504 (in a stream, an error event); default: no limit"
        },
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM or SIGINT, seconds the requests in flight may take to finish; "
            "those still running then end with an error"
        },
    )
    log_requests: bool = field(
        default=False,
        metadata={
            "help": "log each request (choice) as it arrives (prompt tokens, sampling) and as "
            "it ends (finish reason, tokens, TTFT, E2E); never its text"
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "parse tool calls out of chat outputs with this model family's syntax "
            "(hermes: Hermes/Qwen `<tool_call>` blocks; llama3_json: Llama 3.x JSON); "
            "without it, requests with tools get a 400",
            "choices": ["hermes", "llama3_json"],  # NOTE: frontend/tool_parsers.py's
        },
    )
    log_stats_interval: float = field(
        default=10.0,
        metadata={
            "help": "seconds between log lines of throughput, running/waiting requests and "
            "KV use (0: none)"
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "where converted models are cached (default ~/.cache/gyrfalcon)"},
    )
    check_invariants: bool = field(
        default=False, metadata={"help": "run page-allocator integrity checks every step"}
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata={"help": "plan each step only after the previous one's result is back"},
    )
    separate_prefill_steps: bool = field(
        default=False,
        metadata={
            "help": "run prompts and prefill chunks in steps of their own, never beside "
            "decoding or verifying rows (SGLang without --enable-mixed-chunk); with "
            "EAGLE3 a step holding a prompt runs the drafter's round eagerly over all rows"
        },
    )
    disable_prefix_caching: bool = field(
        default=False,
        metadata={"help": "compute every prompt in full (default: KV pages shared by content)"},
    )
    # parallelism (SGLang's flag names)
    tp_size: int = field(
        default=1,
        metadata={"help": "tensor-parallel ranks: one worker process (and GPU) each"},
    )
    dp_size: int = field(
        default=1,
        metadata={
            "help": "data-parallel groups: each runs its own batch on its own KV cache "
            "(and GPUs), requests balanced over them by the one scheduler"
        },
    )
    ep_size: int = field(
        default=1,
        metadata={
            "help": "expert parallelism of MoE layers: 1 splits every expert over the TP "
            "ranks (MoE-TP); the tp size gives each TP rank E / tp whole experts; tp x dp "
            "(with --dp-size > 1: DP attention) gives every rank E / (tp x dp) experts, "
            "each DP group attending over its own requests"
        },
    )
    nnodes: int = field(
        default=1,
        metadata={
            "help": "nodes (hosts) the ranks run on, tp x dp / nnodes each: start `gyrfalcon "
            "serve` with the same flags on every node, each with its own --node-rank"
        },
    )
    node_rank: int = field(
        default=0,
        metadata={
            "help": "this node, in [0, --nnodes): node 0 (the head) runs the HTTP server, the "
            "scheduler and ranks [0, k); node n only ranks [n k, (n + 1) k), on cuda:0..k-1"
        },
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata={
            "help": "HOST:PORT (or tcp://HOST:PORT) of the head, where the ranks meet "
            "(torch.distributed's store; with --nnodes > 1 also PORT+1.. for the nodes' "
            "ZMQ sockets, docs/architecture.md); default: a free port on this host"
        },
    )
    dist_timeout: float = field(
        default=20.0,
        metadata={"help": "seconds a rank waits in a collective before it fails"},
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata={
            "help": "TP all-reduces, and DP attention's expert gathers and sums, all "
            "through NCCL (default on CUDA: small ones in one Triton launch over "
            "symmetric memory)"
        },
    )
    # speculative decoding (SGLang's flag names)
    speculative_algorithm: str | None = field(
        default=None,
        metadata={"help": "EAGLE3: draft with an EAGLE3 head, verify with the model"},
    )
    speculative_draft_model_path: str | None = field(
        default=None, metadata={"help": "the EAGLE3 head's directory (config.json + safetensors)"}
    )
    speculative_num_steps: int | None = field(
        default=None, metadata={"help": "draft tokens per step, k (default 3 with EAGLE3)"}
    )
    speculative_eagle_topk: int = field(
        default=1, metadata={"help": "draft branches per step; 1 (chain drafting) only"}
    )
    speculative_num_draft_tokens: int | None = field(
        default=None, metadata={"help": "tokens verified per step, k + 1 (default: from k)"}
    )
    speculative_attention_mode: str = field(
        default="decode",
        metadata={
            "help": "backend of target verify and draft extend: the decode backend's "
            "(default: it reads lengths on the device, so a verify row may be planned "
            "before the previous one's accept length is back) or the prefill backend's",
            "choices": ["prefill", "decode"],
        },
    )

    def __post_init__(self) -> None:
        # NOTE: at parse time, before a model loads: a misspelt node fails at once
        check_nodes(self.nnodes, self.node_rank, self.tp_size * self.dp_size, self.dist_init_addr)
        if self.api_server_count is not None and self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("--request-timeout must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be >= 1")

    # ---- helpers -------------------------------------------------------

    def resolved(self, model: ModelConfig | None = None) -> ServerArgs:
        """Return a copy with every "auto" resolved for this machine (and, when the
        model's config is given, for that model): `config/resolve.py`."""
        return resolve_server_args(self, model)

    @property
    def num_api_servers(self) -> int:
        """--api-server-count, or one a DP rank when it is not given (as vLLM: each DP
        rank's token rate can take a frontend's core, benchmarks/NOTES.md stop 52)."""
        return self.dp_size if self.api_server_count is None else self.api_server_count

    @property
    def spec_attention_backend(self) -> str:
        """The backend of VERIFY and DRAFT_EXTEND (resolved args)."""
        if self.speculative_attention_mode == "decode":
            return self.decode_attention_backend
        return self.attention_backend

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per spec row, k (0 without speculative decoding; resolved args)."""
        return (self.speculative_num_steps or 0) if self.speculative_algorithm else 0

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache element type for a model running in model_dtype."""
        import torch

        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8_e4m3" else model_dtype

    def joins_process_groups(self) -> bool:
        """Whether the worker ranks join torch.distributed process groups: TP ranks
        share collectives, and so do all ranks when MoE experts split over them."""
        return self.tp_size > 1 or self.ep_size > 1

    def dp_ranks_agree(self) -> bool:
        """Whether the DP ranks' collectives span the DP groups (MoE experts split over
        every rank with DP attention): then every step all ranks run eagerly or all
        replay graphs padded to one size (`StepPlan.graph_rows`)."""
        return self.dp_size > 1 and self.ep_size == self.tp_size * self.dp_size > 1

    def node_ranks(self) -> range:
        """The worker ranks this node runs: tp x dp split evenly over --nnodes, node n
        running [n k, (n + 1) k); on CUDA rank r uses the node's cuda:(r - n k)."""
        k = self.tp_size * self.dp_size // self.nnodes
        return range(self.node_rank * k, (self.node_rank + 1) * k)

    def graph_mode(self) -> str | None:
        """How decode runs: "cuda" graphs, "static" buffer replay, or None (eager)."""
        if self.static_graph_replay:
            return "static"
        if self.device.startswith("cuda") and not self.enforce_eager:
            return "cuda"
        return None

    def graph_batch_sizes(self) -> list[int] | None:
        if not self.cuda_graph_bs:
            return None
        return [int(x) for x in self.cuda_graph_bs.split(",") if x.strip()]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
