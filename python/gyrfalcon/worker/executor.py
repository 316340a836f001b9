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
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.device import set_launch_pdl
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.layers.attention.registry import create_backend
from gyrfalcon.models.registry import build_model
from gyrfalcon.worker.cuda_graph import GraphRunner
from gyrfalcon.worker.sampler import argmax_rows

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardOutput:
    """What one forward pass hands to sampling."""

    logits: torch.Tensor  # [n, vocab] in the model dtype, of the rows asked for
    argmax: torch.Tensor | None  # [n] their argmax, when a graph computed it already
    hidden: torch.Tensor | None  # [T, hidden] every token's final hidden state (eager only)


class ModelExecutor:
    def __init__(self, args: ServerArgs, cfg: ModelConfig, model_dir: str, device: torch.device):
        """Load the model; call init_kv_cache() next. `args` must be resolved."""
        self.args, self.cfg, self.device = args, cfg, device
        self.dtype = DTYPES[args.dtype]
        self.page_size = args.page_size
        set_launch_pdl(not args.disable_pdl)
        t0 = time.perf_counter()
        self.model = build_model(cfg, model_dir, self.dtype, device, args.load_format)
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        self.attn = create_backend(args.attention_backend, *shape)  # prefill / mixed batches
        self.decode_attn = (
            self.attn
            if args.decode_attention_backend == args.attention_backend
            else create_backend(args.decode_attention_backend, *shape)
        )
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None

    def init_kv_cache(self, num_pages: int, max_model_len: int) -> None:
        """Allocate the paged KV cache (after weights, so sizing sees their memory),
        then set up decode graphs for contexts up to max_model_len."""
        c = self.cfg
        self.kv_cache = KVCache(
            c.num_layers,
            num_pages,
            self.page_size,
            c.num_kv_heads,
            c.head_dim,
            self.args.kv_dtype(self.dtype),
            self.device,
        )
        mode = self.args.graph_mode()
        if mode == "cuda" and not self.decode_attn.supports_cuda_graph:
            name = self.decode_attn.name
            logger.warning("%s backend cannot be captured; decode runs eagerly", name)
            mode = None
        if mode is None:
            return
        self.graphs = GraphRunner(
            self._decode_logits,
            self.decode_attn,
            self.kv_cache,
            self.page_size,
            max_bs=min(self.args.cuda_graph_max_bs, self.args.max_num_seqs),
            max_pages=-(-max_model_len // self.page_size),
            device=self.device,
            mode=mode,
            sizes=self.args.graph_batch_sizes(),
        )
        self.graphs.capture()

    def _decode_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured function: a decode batch -> (logits [bs, vocab] in the model
        dtype, their argmax [bs]: the tokens of greedy rows without penalties, sampled
        in the graph)."""
        logits = self.model.compute_logits(self.model(batch))
        return logits, argmax_rows(logits)

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        return self.decode_attn if mode == ForwardMode.DECODE else self.attn

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype."""
        return self.model.compute_logits(hidden)

    def forward(
        self, mode: ForwardMode, bt: BatchTensors, logit_rows: torch.Tensor, every_row: bool
    ) -> ForwardOutput:
        """Run the batch: through a captured graph when one serves it and every row
        wants logits (`every_row`), else eagerly. logit_rows: [n] int64, the batch rows
        whose last token's logits are returned."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        if every_row and self.graphs is not None and self.graphs.can_run(mode, bt):
            logits, argmax = self.graphs.run(bt)  # [bs, vocab], [bs]
            return ForwardOutput(logits, argmax, None)
        attn = self.backend_for(mode)
        batch = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, attn)
        batch.attn_meta = attn.build_metadata(batch)
        hidden = self.model(batch)  # [T, hidden]
        logits = self.compute_logits(hidden[bt.last_token_idx[logit_rows]])
        return ForwardOutput(logits, None, hidden)
