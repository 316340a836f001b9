"""The EAGLE3 drafter of one target on one device: its model (sharing the target's
embedding), its own one-layer KV cache, its attention backends.

The drafter's KV lives in its own pages: a cache of the target's page count and
geometry, indexed by the same page tables the scheduler hands out, so every page
a request holds holds its target KV and its drafter KV, and both come back
together.

One draft round, after the target has verified a step (`DraftRound` lists the
rows; the module docstring of models/llama_eagle3.py has the token convention):

1. DRAFT_EXTEND over every token the target computed for the drafting rows: the
   feature fc(aux) at position p with the token at p + 1 (the row's next input,
   then the tokens it emitted; a prefill chunk's next prompt token). Verify rows
   extend over all k + 1 positions; those after the last accepted one hold
   garbage that the next steps overwrite before anything reads them.
2. The output at each sampling row's last verified position (its anchor,
   `last_accepted_index`) proposes draft 1.
3. k - 1 DRAFT_DECODE steps: step j feeds draft j at anchor + j with the previous
   step's output; its batch is built on the device (`advanced_rows`: the anchor
   depends on the accept lengths, which the host does not wait for), so the
   decode backend reads lengths from the device (`device_lengths`).

Nothing here syncs with the host. The drafts are written to the request table's
`draft_tokens`, where the next verify row reads them.

Graphs: a round whose rows are all verify rows of k drafts (the steady state) runs
as ONE replay, keyed DRAFT_EXTEND with k + 1 tokens per row: the extend, the anchor
gather and every draft step are in the captured callable (`_round`), the step
batches built on the device inside it. The extend's metadata is planned before the
replay from the static batch, as for VERIFY; the accept lengths, aux states and
last positions ride in static buffers of their own (`RoundInputs`), padded rows
with zeros (accept 0, position 0 on the dummy page).

Any other round (a step with prompts or prefill chunks, rows of fewer drafts) runs
its extend over rows of any length: through the drafter's own piecewise graphs
(worker/piecewise_graph.py: one whole graph on triton, else pieces around an eager
attention) where they hold its tokens, the round's aux states gathered into their
static input (`ext_aux`), else eagerly. Then everything after it runs as ONE replay
keyed DRAFT_DECODE, one row per proposing row (`_after_extend`): draft 1 from the
extend's output at each anchor and the k - 1 draft steps. Its static batch holds
each row at its anchor (position, page table), the anchor's hidden state and last
position in `RoundInputs`; padded rows as above.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors, advanced_rows
from gyrfalcon.ipc.contract import piecewise_sizes
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.registry import backend_class, create_backends
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import VocabEmbedding
from gyrfalcon.models.registry import build_draft_model
from gyrfalcon.worker.cuda_graph import GraphRunner, GraphSpec, padded_batch_size
from gyrfalcon.worker.draft_round import DraftRound, build_round, round_ids
from gyrfalcon.worker.piecewise_graph import PiecewiseGraphs
from gyrfalcon.worker.sampler import argmax_rows
from gyrfalcon.worker.spec_accept import last_accepted_indices
from gyrfalcon.worker.step_layout import StepLayout
from gyrfalcon.worker.warmup import warm_up_roles

logger = logging.getLogger(__name__)


@dataclass
class RoundInputs:
    """Static inputs of a captured round besides its batch."""

    aux: torch.Tensor  # [max_bs * (k + 1), 3 * H_target] the extend tokens' aux states
    accept: torch.Tensor  # [max_bs] int64 drafts each row accepted
    last_pos: torch.Tensor  # [max_bs] int64 last position each row may write
    hidden: torch.Tensor  # [max_bs, H] the extend's output at each anchor (DRAFT_DECODE)


class Drafter:
    def __init__(
        self,
        args: ServerArgs,
        target: ModelConfig,
        embed_tokens: VocabEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        ctx: LayerContext,
    ):
        """Load the drafter of `args.speculative_draft_model_path` for `target` (checked
        before any weight is copied: ValueError says what does not fit)."""
        path = args.speculative_draft_model_path
        assert path is not None and args.speculative_num_steps, "resolved spec args"
        self.k = args.speculative_num_steps
        self.cfg = DraftConfig.from_dir(path)
        self.page_size, self.device, self.args = args.page_size, device, args
        self.model = build_draft_model(
            self.cfg, target, path, dtype, device, ctx, embed_tokens, args.load_format, False
        )
        self.aux_layers = self.model.aux_layer_ids(target.num_layers)
        lyr = self.cfg.layer
        self.heads = ctx.parallel.heads(lyr.num_heads, lyr.num_kv_heads)
        shape = (self.heads.num_heads, self.heads.num_kv_heads, lyr.head_dim, lyr.head_dim**-0.5)
        decode = args.decode_attention_backend
        if not backend_class(decode).device_lengths:
            # NOTE: draft steps know their lengths on the device only (module docstring)
            decode = "triton" if device.type == "cuda" else "torch_ref"
            logger.info("draft steps attend with %s (device-side lengths)", decode)
        # NOTE: DRAFT_EXTEND (the extend role) attends like the target's VERIFY
        extend = args.spec_attention_backend
        self.backends = create_backends(extend, decode, *shape, kernels=ctx.kernels)
        self.dtype = dtype
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None
        self.static: RoundInputs | None = None
        # mixed rounds' extends (module docstring), and their aux states [T, 3 * H_target]
        self.piecewise: PiecewiseGraphs | None = None
        self.ext_aux: torch.Tensor | None = None

    def init_kv_cache(self, num_pages: int, kv_dtype: torch.dtype) -> None:
        """The drafter's own pages: as many as the target's, one layer each."""
        lyr = self.cfg.layer
        self.kv_cache = KVCache(
            1,
            num_pages,
            self.page_size,
            self.heads.num_kv_heads,
            lyr.head_dim,
            kv_dtype,
            self.device,
            self.model.ctx.kernels,
        )

    def warm_up_kernels(self, max_rows: int) -> None:
        """The kernel builds of its eager steps, batches of up to max_rows rows:
        DRAFT_EXTEND rows, and DRAFT_DECODE batches its round graphs do not hold
        (`warm_up_roles`; the target's warm-up made them already where the drafter
        attends with the target's shapes)."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        warm_up_roles(self.backends, self.graphs, ForwardMode.DRAFT_DECODE, self.kv_cache,
                      self.dtype, max_rows, self.page_size)  # fmt: skip

    def setup_graphs(self, max_model_len: int) -> None:
        """Capture the round of verify rows (module docstring) for every capture size, or
        set up its static replay, per the server arguments."""
        args, k1 = self.args, self.k + 1
        mode = args.graph_mode()
        assert self.kv_cache is not None, "init_kv_cache() first"
        if mode is None:
            return
        extend = self.backends.extend
        if mode == "cuda" and not extend.supports_cuda_graph:
            logger.warning("%s backend cannot be captured; draft rounds run eagerly", extend.name)
            return
        max_bs = min(args.cuda_graph_max_bs, args.max_num_seqs)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.static = RoundInputs(
            aux=torch.zeros(max_bs * k1, 3 * self.cfg.target_hidden_size, dtype=self.dtype,
                            device=self.device),
            accept=torch.zeros(max_bs, **i64),
            last_pos=torch.zeros(max_bs, **i64),
            hidden=torch.zeros(max_bs, self.cfg.hidden_size, dtype=self.dtype, device=self.device),
        )  # fmt: skip
        specs = [GraphSpec(ForwardMode.DRAFT_EXTEND, k1, self._round, extend)]
        decode = self.backends.decode
        if mode == "static" or decode.supports_cuda_graph:
            specs.append(GraphSpec(ForwardMode.DRAFT_DECODE, 1, self._after_extend, decode))
        pages = -(-max_model_len // self.page_size)
        self.graphs = GraphRunner(
            specs, self.kv_cache, self.page_size, max_bs, pages, self.device, mode,
            args.graph_batch_sizes(),
        )  # fmt: skip
        self._setup_piecewise(mode, pages)  # NOTE: first, as the target's (executor.setup_graphs)
        self.graphs.capture()

    def _setup_piecewise(self, mode: str, max_pages: int) -> None:
        """Piecewise graphs for the extends of mixed rounds, at the target's sizes (up to
        --piecewise-cuda-graph-max-tokens), whole ones over up to --max-num-seqs rows
        where the extend backend serves them. Not where the DP ranks agree on graphs
        (`dp_ranks_agree`): those rounds stay eager."""
        sizes = piecewise_sizes(self.args.piecewise_cuda_graph_max_tokens)
        if not sizes or self.args.dp_ranks_agree():
            return
        assert self.kv_cache is not None
        width = 3 * self.cfg.target_hidden_size
        self.ext_aux = torch.zeros(sizes[-1], width, dtype=self.dtype, device=self.device)
        self.piecewise = PiecewiseGraphs(
            self._extend_outputs, self.backends.extend, self.kv_cache, self.dtype,
            self.page_size, self.device, mode, sizes, self.args.max_num_seqs, max_pages,
        )  # fmt: skip
        self.piecewise.capture()

    def _extend_outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """A piecewise pass: the extend over the static tokens and aux rows (finite)."""
        assert self.ext_aux is not None
        return (self.model(batch, self.model.fuse(self.ext_aux[: batch.num_tokens])),)

    def _round(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """The captured round over a static batch of verify rows (k + 1 tokens each) ->
        the drafts laid out per token, [bs * (k + 1)]: row r's k drafts at tokens
        r * (k + 1) .. r * (k + 1) + k - 1, then a 0 (graph outputs are per token)."""
        assert self.static is not None
        bs, k1 = batch.batch_size, self.k + 1
        st = self.static
        drafts = self.verify_round(batch, st.aux[: bs * k1], st.accept[:bs], st.last_pos[:bs])
        return (torch.cat([drafts, drafts.new_zeros(bs, 1)], dim=1).view(-1),)

    def _after_extend(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """The captured steps after an eager extend, over a static DRAFT_DECODE batch of
        one row per proposing row at its anchor (module docstring) -> its [bs, k] drafts."""
        assert self.static is not None
        bs, st = batch.batch_size, self.static
        cap = batch.page_table.shape[1] * self.page_size - 1
        bound = [n - 1 for n in batch.seq_lens_cpu]  # NOTE: the anchors' host bounds
        drafts = self._steps(
            st.hidden[:bs], batch.positions, st.last_pos[:bs], batch.page_table, bound, [cap] * bs
        )
        return (drafts,)

    def verify_round(
        self,
        batch: ForwardBatch,
        aux: torch.Tensor,
        accepted: torch.Tensor,
        last_pos: torch.Tensor,
    ) -> torch.Tensor:
        """The round over a DRAFT_EXTEND batch of verify rows (k + 1 tokens each, at the
        positions the target verified, ids: the token after each) -> [bs, k] drafts.
        aux: [bs * (k + 1), 3 * H_target]; accepted, last_pos: [bs] int64. Host-free:
        graphs capture it (`_round`, worker/spec_step_graph.py)."""
        bs, k1 = batch.batch_size, self.k + 1
        out = self.model(batch, self.model.fuse(aux))
        anchor = batch.positions[::k1] + accepted  # [bs]
        cap = batch.page_table.shape[1] * self.page_size - 1
        bound = [n - 1 for n in batch.seq_lens_cpu]  # NOTE: anchors with every draft accepted
        return self._steps(
            out[last_accepted_indices(accepted, self.k)],
            anchor,
            last_pos,
            batch.page_table,
            bound,
            [cap] * bs,
        )

    def extend_view(self, like: ForwardBatch, input_ids: torch.Tensor) -> ForwardBatch:
        """A DRAFT_EXTEND batch over `like`'s rows (positions, slots, lengths, pages:
        the same tensors) with `input_ids`, the drafter's KV cache and its extend
        backend's metadata (views of those tensors where the backend captures)."""
        attn = self.backends.extend
        batch = dataclasses.replace(
            like, mode=ForwardMode.DRAFT_EXTEND, input_ids=input_ids, kv_cache=self.kv_cache,
            attn_backend=attn, attn_meta=None,
        )  # fmt: skip
        replay = attn.supports_cuda_graph
        batch.attn_meta = attn.prepare_replay(batch) if replay else attn.build_metadata(batch)
        return batch

    def _steps(
        self,
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        last_pos: torch.Tensor,
        page_table: torch.Tensor,
        anchor_cpu: list[int],
        last_cpu: list[int],
    ) -> torch.Tensor:
        """Draft 1 from hidden [m, H] (the extend's output at each anchor), then the k - 1
        draft steps -> [m, k] drafts (target ids). anchor_cpu / last_cpu: host upper
        bounds of anchor and last_pos."""
        drafts = [self._propose(hidden)]
        for j in range(1, self.k):
            bound = [min(a + j, last) + 1 for a, last in zip(anchor_cpu, last_cpu)]
            bt = advanced_rows(drafts[-1], anchor, j, last_pos, page_table, self.page_size, bound)
            hidden = self._forward(ForwardMode.DRAFT_DECODE, bt, hidden)
            drafts.append(self._propose(hidden))
        return torch.stack(drafts, dim=1)

    def _forward(self, mode: ForwardMode, bt: BatchTensors, hidden: torch.Tensor) -> torch.Tensor:
        assert self.kv_cache is not None, "init_kv_cache() first"
        attn = self.backends.for_mode(mode)
        batch = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, attn)
        batch.attn_meta = attn.build_metadata(batch)
        return self.model(batch, hidden)

    def _propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's greedy token (a target id) after each row of hidden [m, H]."""
        logits = self.model.compute_logits(hidden)
        return self.model.to_target_ids(argmax_rows(logits, self.model.ctx.kernels))

    def draft(
        self,
        rnd: DraftRound,
        ids: torch.Tensor,
        aux: torch.Tensor,
        accept_len: torch.Tensor,
        draft_tokens: torch.Tensor,
    ) -> None:
        """Run one round (module docstring) and write each proposing row's k drafts into
        draft_tokens[slot]. ids: the step's token ids that `ext_ids_src` indexes; aux:
        the target's [T, 3H] aux states; accept_len: [S] drafts accepted by each
        sampling row of the step (0 for rows without drafts)."""
        rnd.ext.input_ids.copy_(ids[rnd.ext_ids_src])
        graphs = self.graphs
        if rnd.uniform and graphs is not None and graphs.can_run(ForwardMode.DRAFT_EXTEND, rnd.ext):
            aux_rows = aux[rnd.ext_aux_idx]  # [Te, 3 * H_target]
            drafts = self._replay(rnd, aux_rows, accept_len[rnd.accept_row], graphs)
        else:
            out = self._extend(rnd, aux)
            if not rnd.slots.numel():
                return
            accepted = accept_len[rnd.accept_row]  # [m]
            hidden = out[rnd.anchor_idx + accepted]
            anchor = rnd.ext.positions[rnd.anchor_idx] + accepted
            table = rnd.ext.page_table[rnd.ext_row]
            at = None
            if graphs is not None:  # NOTE: ids unread; host bounds: every draft accepted
                bound = [a + 1 for a in rnd.anchor_pos_cpu]
                at = advanced_rows(anchor, anchor, 0, rnd.last_pos, table, self.page_size, bound)
            if at is not None and graphs.can_run(ForwardMode.DRAFT_DECODE, at):
                drafts = self._replay_after_extend(at, hidden, rnd.last_pos, graphs)
            else:
                drafts = self._steps(
                    hidden, anchor, rnd.last_pos, table, rnd.anchor_pos_cpu, rnd.last_pos_cpu
                )
        draft_tokens.index_copy_(0, rnd.slots, drafts)

    def _extend(self, rnd: DraftRound, aux: torch.Tensor) -> torch.Tensor:
        """A mixed round's DRAFT_EXTEND -> its output rows [Te, H]: through the piecewise
        graphs where they hold its tokens (a view of their static output, valid until
        their next run), else eagerly."""
        pw, ext = self.piecewise, rnd.ext
        if pw is not None and pw.can_run(ext):
            assert self.ext_aux is not None
            torch.index_select(aux, 0, rnd.ext_aux_idx, out=self.ext_aux[: ext.input_ids.shape[0]])
            (out,) = pw.run(ForwardMode.DRAFT_EXTEND, ext, self.backends.extend)
            return out
        aux_rows = aux[rnd.ext_aux_idx]  # [Te, 3 * H_target]
        return self._forward(ForwardMode.DRAFT_EXTEND, ext, self.model.fuse(aux_rows))

    def _replay(
        self, rnd: DraftRound, aux_rows: torch.Tensor, accepted: torch.Tensor, graphs: GraphRunner
    ) -> torch.Tensor:
        """The round through the graph runner -> [bs, k] drafts (`_round`)."""
        assert self.static is not None
        st, k1 = self.static, self.k + 1
        bs = len(rnd.ext.seq_lens_cpu)
        padded = padded_batch_size(bs, graphs.sizes)
        st.aux[: bs * k1].copy_(aux_rows)
        st.accept[:bs].copy_(accepted)
        st.last_pos[:bs].copy_(rnd.last_pos)
        if padded > bs:
            st.aux[bs * k1 : padded * k1].zero_()
            st.accept[bs:padded].zero_()
            st.last_pos[bs:padded].zero_()
        (flat,) = graphs.run(ForwardMode.DRAFT_EXTEND, rnd.ext)
        return flat.view(bs, k1)[:, : self.k]

    def _replay_after_extend(
        self, at: BatchTensors, hidden: torch.Tensor, last_pos: torch.Tensor, graphs: GraphRunner
    ) -> torch.Tensor:
        """The steps after an eager extend through the graph runner (`_after_extend`):
        at, the rows at their anchors; hidden [m, H] the extend's output there -> [m, k]."""
        assert self.static is not None
        st, m = self.static, hidden.shape[0]
        padded = padded_batch_size(m, graphs.sizes)
        st.hidden[:m].copy_(hidden)
        st.last_pos[:m].copy_(last_pos)
        if padded > m:
            st.hidden[m:padded].zero_()
            st.last_pos[m:padded].zero_()
        (drafts,) = graphs.run(ForwardMode.DRAFT_DECODE, at)
        return drafts

    def draft_step(
        self,
        layout: StepLayout,
        bt: BatchTensors,
        emitted: torch.Tensor | None,
        accept_len: torch.Tensor | None,
        next_ids: torch.Tensor,
        aux: torch.Tensor | None,
        floating: tuple[torch.Tensor, torch.Tensor] | None,
        shared: list[torch.Tensor] | None,
        draft_tokens: torch.Tensor,
    ) -> None:
        """The round over a target step's drafting rows (`draft`): layout and bt are the
        step's, emitted / accept_len its sampled ids, next_ids the next prompt tokens of
        drafted chunks, aux the target's aux hidden states; floating and shared as
        `draft_round.build_round` takes them. The drafts go to draft_tokens (the request
        table's)."""
        rnd = build_round(layout, bt, floating, shared, self.page_size, self.device)
        ids, accept_len = round_ids(layout, bt, emitted, accept_len, next_ids)
        self.draft(rnd, ids, aux, accept_len, draft_tokens)
