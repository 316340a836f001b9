"""Model executor: one model on one device, its KV cache, its attention backends and
its captured graphs.

It knows nothing of requests: it runs a forward batch the step worker built and
returns logits. A process may hold several (a target and its drafter; one per
rank), so it keeps no state outside itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.forward.parallel import SINGLE_RANK, ParallelContext
from gyrfalcon.ipc.contract import piecewise_sizes
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.layers.attention.registry import create_backends
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import SparseMoeBlock
from gyrfalcon.models.registry import build_model
from gyrfalcon.worker.cuda_graph import GraphRunner, GraphSpec
from gyrfalcon.worker.piecewise_graph import PiecewiseGraphs
from gyrfalcon.worker.sampler import argmax_rows
from gyrfalcon.worker.warmup import warm_up_roles

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardOutput:
    """What one forward pass hands to sampling."""

    logits: torch.Tensor  # [n, vocab] in the model dtype: of the tokens asked for
    argmax: torch.Tensor | None  # [n] their argmax, when a graph computed it already
    hidden: torch.Tensor | None  # [T, hidden] every token's final hidden state (eager only)
    # [T, 3 * hidden] every token's aux hidden states (`aux_layers`), concatenated in
    # their order: what an EAGLE3 drafter fuses; None unless the executor captures them
    aux: torch.Tensor | None = None
    # how: "graph", "whole" or "piecewise" (worker/piecewise_graph.py), or "eager"
    ran: str = "eager"


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
            args.attention_backend,
            args.decode_attention_backend,
            *shape,
            kernels=kernels,
            verify=args.spec_attention_backend,
        )
        self.attn, self.decode_attn = self.backends.extend, self.backends.decode
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None  # the eager path's forwards
        # target layers whose inputs every forward also returns (`ForwardOutput.aux`);
        # set before the graphs are captured, by the drafter that reads them
        self.aux_layers: tuple[int, ...] | None = None

    def init_kv_cache(
        self,
        num_pages: int,
        max_model_len: int,
        verify_tokens_per_row: int | None = None,
        extra_specs: Sequence[GraphSpec] = (),
    ) -> None:
        """Allocate the paged KV cache (after weights, so sizing sees their memory),
        then set up graphs for contexts up to max_model_len (`setup_graphs`)."""
        self.alloc_kv_cache(num_pages)
        self.setup_graphs(max_model_len, verify_tokens_per_row, extra_specs)

    def alloc_kv_cache(self, num_pages: int) -> None:
        """The paged KV cache alone (no graphs: eager steps only)."""
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

    @property
    def graph_max_bs(self) -> int:
        """The largest batch the graphs serve."""
        return min(self.args.cuda_graph_max_bs, self.args.max_num_seqs)

    def setup_graphs(
        self,
        max_model_len: int,
        verify_tokens_per_row: int | None = None,
        extra_specs: Sequence[GraphSpec] = (),
    ) -> None:
        """Capture graphs (or set up static replay, per the server arguments) for
        contexts up to max_model_len: DECODE always; VERIFY of `verify_tokens_per_row`
        (k + 1) tokens per row only when asked (with speculative decoding), and its
        variants in `extra_specs` (worker/spec_step_graph.py), in the same memory pool.
        Replaces the graphs set up before."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        self.graphs = None
        mode = self.args.graph_mode()
        if mode == "cuda" and not getattr(self.model, "captures_cuda_graphs", True):
            name = type(self.model).__name__
            logger.warning("%s cannot be captured in CUDA graphs here: it runs eagerly", name)
            return
        if mode is None:
            return
        specs = [GraphSpec(ForwardMode.DECODE, 1, self.token_logits, self.backends.decode)]
        if verify_tokens_per_row is not None:
            assert verify_tokens_per_row >= 2, "a verify row scores k + 1 >= 2 tokens"
            verify = self.backends.verify
            specs.append(
                GraphSpec(ForwardMode.VERIFY, verify_tokens_per_row, self.token_logits, verify)
            )
            specs.extend(extra_specs)
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
            max_bs=self.graph_max_bs,
            max_pages=-(-max_model_len // self.page_size),
            device=self.device,
            mode=mode,
            sizes=self.args.graph_batch_sizes(),
        )
        # NOTE: the piecewise graphs first: with the step graphs captured after them,
        # SmolLM2 decoded 5-8% more tokens/s at batch 1 and 3% at batch 16 (nvidia-h200,
        # benchmarks/NOTES.md, stop 68; why the order matters is not known)
        self._setup_piecewise(mode, -(-max_model_len // self.page_size))
        with self.ctx.parallel.rows_agreed():  # NOTE: graphs run only at agreed sizes
            self.graphs.capture()

    def _setup_piecewise(self, mode: str, max_pages: int) -> None:
        """Piecewise graphs for the eager path (worker/piecewise_graph.py), up to
        --piecewise-cuda-graph-max-tokens tokens, whole ones over up to --max-num-seqs
        rows where the backend serves them. Where the ranks bring their own tokens to
        the MoE layers (DP attention), every rank captures the same sizes in the same
        order, gathering equal rows, and runs them only at the plan's agreed size
        (`StepPlan.graph_tokens`)."""
        self.piecewise = None
        sizes = piecewise_sizes(self.args.piecewise_cuda_graph_max_tokens)
        if not sizes:
            return
        assert self.kv_cache is not None
        self.piecewise = PiecewiseGraphs(
            self._model_outputs, self.backends.extend, self.kv_cache, self.dtype,
            self.page_size, self.device, mode, sizes, self.args.max_num_seqs, max_pages,
        )  # fmt: skip
        with self.ctx.parallel.rows_agreed():  # NOTE: a no-op where the tokens are shared
            self.piecewise.capture()

    def warm_up_kernels(self, max_rows: int) -> None:
        """The eager path's kernel variants the warm-up steps do not meet, for batches of
        up to max_rows rows (`AttentionBackend.warm_up_kernels`; under DP attention the
        warm-up's own steps are eager, two rows each), and the fused MoE
        kernels' for any step's token count (`SparseMoeBlock.warm_up_kernels`)."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        # NOTE: where the DP ranks agree on graphs, another group's prompt step over the
        # piecewise sizes runs a DECODE batch of any row count eagerly (RoPE inside the
        # decode kernel, a build per split count): every row count is eager then
        graphs = None if self.args.dp_ranks_agree() else self.graphs
        warm_up_roles(self.backends, graphs, ForwardMode.DECODE, self.kv_cache, self.dtype,
                      max_rows, self.page_size)  # fmt: skip
        # NOTE: one MoE layer builds the kernels of all (they share shapes); an eager step
        # under DP attention gathers every group's tokens
        budget = self.args.max_num_batched_tokens
        assert budget is not None, "resolved server args"
        moe = next((m for m in self.model.modules() if isinstance(m, SparseMoeBlock)), None)
        if moe is not None:
            moe.warm_up_kernels(budget * self.args.dp_size)

    def _model_outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """(final hidden states,) or (them, the aux states): what a pass of piecewise
        graphs returns."""
        hidden, aux = self._run_model(batch)
        return (hidden,) if aux is None else (hidden, aux)

    def token_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The captured function of every mode: a static batch -> (logits [T, vocab] of
        every token in the model dtype, their argmax [T]: for DECODE (T = bs) the tokens
        of greedy rows without penalties, sampled in the graph; for VERIFY (T = bs *
        (k + 1)) the target's choice at each draft position), then the aux hidden
        states [T, 3 * hidden] when `aux_layers` is set."""
        hidden, aux = self._run_model(batch)
        logits = self.model.compute_logits(hidden)
        out = (logits, argmax_rows(logits, self.ctx.kernels))
        return out if aux is None else (*out, aux)

    def _run_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states [T, hidden], aux states [T, 3 * hidden] or None)."""
        if self.aux_layers is None:
            return self.model(batch), None
        hidden, aux = self.model.forward_aux(batch, self.aux_layers)
        return hidden, torch.cat(aux, dim=-1)

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        return self.backends.for_mode(mode)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype."""
        return self.model.compute_logits(hidden)

    def forward(
        self,
        mode: ForwardMode,
        bt: BatchTensors,
        logit_tokens: torch.Tensor,
        every_token: bool,
        graph_rows: int | None = None,
        graph_tokens: int = 0,
    ) -> ForwardOutput:
        """Run the batch: through a captured graph when one serves its mode and size and
        every token wants logits (`every_token`: logit_tokens is all T tokens in order,
        e.g. a DECODE or a VERIFY step), else as piecewise graphs when they serve T
        tokens, else eagerly. logit_tokens: [n] int64, the tokens (indices into the
        batch's T) whose logits are returned. graph_rows: where ranks agree on graphs
        (`StepPlan.graph_rows`): 0 runs the piecewise graphs at graph_tokens
        (`StepPlan.graph_tokens`: T padded to it) or, at 0, eagerly; n > 0 the graph
        padded for n rows, which must then serve the batch (every rank decides alike)."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        graphs, rows = self.graphs, graph_rows or 0
        usable = graph_rows != 0 and every_token and graphs is not None
        if usable and graphs.can_run(mode, bt, rows=rows):
            with self.ctx.parallel.rows_agreed():  # NOTE: static replay runs the callable
                logits, argmax, *aux = graphs.run(mode, bt, rows=rows)
            return ForwardOutput(logits, argmax, None, aux[0] if aux else None, "graph")
        assert not (usable and rows) or rows > graphs.sizes[-1], (
            f"the ranks agreed on a graph for {rows} rows that this rank's {mode.name} "
            "batch cannot replay"
        )
        attn, ran, pw = self.backend_for(mode), "eager", self.piecewise
        # NOTE: ranks that agree on graphs run the pieces only at the size they agreed
        # on (its collectives' shapes), every other rank at its own
        size = graph_tokens if graph_rows == 0 else None
        if pw is not None and (size or (graph_rows is None and pw.can_run(bt))):
            with self.ctx.parallel.rows_agreed():  # NOTE: static passes gather eagerly
                hidden, *rest = pw.run(mode, bt, attn, size)
            aux = rest[0] if rest else None
            ran = "whole" if pw.last_whole else "piecewise"
        else:
            batch = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, attn)
            batch.attn_meta = attn.build_metadata(batch)
            with self.ctx.parallel.counts_once():  # NOTE: one row-count exchange, not one a layer
                hidden, aux = self._run_model(batch)  # [T, hidden], [T, 3 * hidden] or None
        logits = self.compute_logits(hidden if every_token else hidden[logit_tokens])
        return ForwardOutput(logits, None, hidden, aux, ran)
