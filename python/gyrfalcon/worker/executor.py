"""Model executor: one model on one device, its KV cache, its attention backends and
its captured graphs.

It knows nothing of requests: it runs a forward batch the step worker built and
returns logits. A process may hold several (a target and its drafter; one per
rank), so it keeps no state outside itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.forward.parallel import SINGLE_RANK, ParallelContext
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.layers.attention.registry import create_backends
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.registry import build_model
from gyrfalcon.worker.cuda_graph import GraphRunner, GraphSpec
from gyrfalcon.worker.sampler import argmax_rows

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardOutput:
    """What one forward pass hands to sampling."""

    # [n, vocab] in the model dtype: of the rows asked for (VERIFY: of every token)
    logits: torch.Tensor
    argmax: torch.Tensor | None  # [n] their argmax, when a graph computed it already
    hidden: torch.Tensor | None  # [T, hidden] every token's final hidden state (eager only)


class ModelExecutor:
    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        model_dir: str,
        device: torch.device,
        parallel: ParallelContext = SINGLE_RANK,
    ):
        """Load this rank's share of the model (`parallel`: its TP rank and group); call
        init_kv_cache() next. `args` must be resolved."""
        self.args, self.cfg, self.device = args, cfg, device
        self.dtype = DTYPES[args.dtype]
        self.page_size = args.page_size
        # NOTE: what every layer, the KV cache, the backends and sampling are built with
        self.ctx = LayerContext(KernelPolicy(pdl=not args.disable_pdl), parallel)
        self.heads = parallel.heads(cfg.num_heads, cfg.num_kv_heads)  # this rank's heads
        t0 = time.perf_counter()
        self.model = build_model(cfg, model_dir, self.dtype, device, self.ctx, args.load_format)
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        shape = (self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        kernels = self.ctx.kernels
        # NOTE: one instance per role (extend, decode, verify): no step overwrites the
        # plan of a step of another role
        self.backends = create_backends(
            args.attention_backend, args.decode_attention_backend, *shape, kernels=kernels
        )
        self.attn, self.decode_attn = self.backends.extend, self.backends.decode
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None

    def init_kv_cache(
        self, num_pages: int, max_model_len: int, verify_tokens_per_row: int | None = None
    ) -> None:
        """Allocate the paged KV cache (after weights, so sizing sees their memory),
        then set up graphs for contexts up to max_model_len (`setup_graphs`)."""
        c = self.cfg
        self.kv_cache = KVCache(
            c.num_layers,
            num_pages,
            self.page_size,
            self.heads.num_kv_heads,
            c.head_dim,
            self.args.kv_dtype(self.dtype),
            self.device,
            self.ctx.kernels,
        )
        self.setup_graphs(max_model_len, verify_tokens_per_row)

    def setup_graphs(self, max_model_len: int, verify_tokens_per_row: int | None = None) -> None:
        """Capture graphs (or set up static replay, per the server arguments) for
        contexts up to max_model_len: DECODE always; VERIFY of `verify_tokens_per_row`
        (k + 1) tokens per row only when asked (opt-in until spec decoding exists).
        Replaces the graphs set up before."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        self.graphs = None
        mode = self.args.graph_mode()
        if mode is None:
            return
        specs = [GraphSpec(ForwardMode.DECODE, 1, self._token_logits, self.backends.decode)]
        if verify_tokens_per_row is not None:
            assert verify_tokens_per_row >= 2, "a verify row scores k + 1 >= 2 tokens"
            verify = self.backends.verify
            specs.append(
                GraphSpec(ForwardMode.VERIFY, verify_tokens_per_row, self._token_logits, verify)
            )
        if mode == "cuda":
            for spec in [s for s in specs if not s.backend.supports_cuda_graph]:
                name, what = spec.backend.name, spec.mode.name
                logger.warning("%s backend cannot be captured; %s runs eagerly", name, what)
                specs.remove(spec)
        if not specs:
            return
        self.graphs = GraphRunner(
            specs,
            self.kv_cache,
            self.page_size,
            max_bs=min(self.args.cuda_graph_max_bs, self.args.max_num_seqs),
            max_pages=-(-max_model_len // self.page_size),
            device=self.device,
            mode=mode,
            sizes=self.args.graph_batch_sizes(),
        )
        self.graphs.capture()

    def _token_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured function of every mode: a static batch -> (logits [T, vocab] of
        every token in the model dtype, their argmax [T]: for DECODE (T = bs) the tokens
        of greedy rows without penalties, sampled in the graph; for VERIFY (T = bs *
        (k + 1)) the target's choice at each draft position)."""
        logits = self.model.compute_logits(self.model(batch))
        return logits, argmax_rows(logits, self.ctx.kernels)

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        return self.backends.for_mode(mode)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype."""
        return self.model.compute_logits(hidden)

    def forward(
        self, mode: ForwardMode, bt: BatchTensors, logit_rows: torch.Tensor, every_row: bool
    ) -> ForwardOutput:
        """Run the batch: through a captured graph when one serves its mode and size and
        every row wants logits (`every_row`), else eagerly. logit_rows: [n] int64, the
        batch rows whose last token's logits are returned; a VERIFY batch returns the
        logits of every token instead ([T, vocab], rows in order, k + 1 each)."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        every_token = mode == ForwardMode.VERIFY
        graphs = self.graphs
        if (every_row or every_token) and graphs is not None and graphs.can_run(mode, bt):
            logits, argmax = graphs.run(mode, bt)  # [T, vocab], [T] (decode: T = bs)
            return ForwardOutput(logits, argmax, None)
        attn = self.backend_for(mode)
        batch = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, attn)
        batch.attn_meta = attn.build_metadata(batch)
        hidden = self.model(batch)  # [T, hidden]
        logits = self.compute_logits(
            hidden if every_token else hidden[bt.last_token_idx[logit_rows]]
        )
        return ForwardOutput(logits, None, hidden)
