"""A second captured mode: VERIFY (k + 1 query tokens per row on a cached prefix)
through static-buffer replay on CPU equals the eager forward, token for token,
with padded batches (3 -> 4, 1 -> 2) and a KV pool of a few pages."""

import pytest
import torch
from verify_util import build_executor, make_case, prefill_prefixes, verify, whole_row_logits

from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.worker.cuda_graph import GraphSpec, graph_keys
from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

CPU = torch.device("cpu")
D, V = ForwardMode.DECODE, ForwardMode.VERIFY


def test_graph_keys_capture_most_tokens_first():
    specs = [GraphSpec(D, 1, None, None), GraphSpec(V, 4, None, None)]
    keys = graph_keys(specs, [1, 2, 4])
    assert keys == [
        GraphKey(V, 4, 4), GraphKey(V, 2, 4), GraphKey(D, 4, 1), GraphKey(V, 1, 4),
        GraphKey(D, 2, 1), GraphKey(D, 1, 1),
    ]  # fmt: skip
    assert [k.num_tokens for k in keys] == [16, 8, 4, 4, 2, 1]
    assert len({hash(k) for k in keys}) == 6  # frozen: usable as dict keys


@pytest.mark.parametrize("ps", [2, 4])
def test_fill_pads_verify_rows_on_the_dummy_page(ps):
    """k = 3: padded rows hold positions 0..3 on the dummy page with seq_len 4; at page
    size 2 their table rows name the dummy page twice."""
    t = 4
    buf = StaticBuffers.allocate(4, 6, ps, CPU, tokens_per_row=(1, t))
    rows = [
        RowInput(5, [11, 12, 13, 14], [3, 7, 9, 2, 4]),
        RowInput(1, [21, 22, 23, 24], [8, 6, 5]),
    ]
    rows = [RowInput(r.start, r.input_ids, r.pages[: -(-(r.start + t) // ps)]) for r in rows]
    bt = build_batch_tensors(rows, ps, CPU)
    buf.tokens.fill_(99)  # dirty, as an earlier replay would leave them
    buf.page_table.fill_(5)
    key = GraphKey(V, 4, t)
    assert buf.fill(bt, key) == [9, 5, t, t]
    real = 2 * t
    assert buf.input_ids[:real].tolist() == bt.input_ids.tolist()
    assert buf.out_cache_loc[:real].tolist() == bt.out_cache_loc.tolist()
    assert buf.input_ids[real : 4 * t].tolist() == [0] * 2 * t
    assert buf.positions[real : 4 * t].tolist() == [0, 1, 2, 3] * 2
    dummy_slots = [DUMMY_PAGE * ps + p % ps for p in range(t)]
    assert buf.out_cache_loc[real : 4 * t].tolist() == dummy_slots * 2
    assert buf.seq_lens[:4].tolist() == [9, 5, t, t]
    assert (buf.page_table[2:4] == DUMMY_PAGE).all()
    batch = buf.forward_batch(key, [9, 5, t, t], None, None)
    assert batch.q_starts.tolist() == [0, 4, 8, 12] and batch.q_lens.tolist() == [t] * 4
    assert batch.num_decode_rows == 0 and batch.mode == V
    batch.check()  # lengths >= 1, within the page tables, shapes consistent
    # the decode view of the same buffers: one token per row, every row a decode row
    dkey = GraphKey(D, 4, 1)
    dbatch = buf.forward_batch(dkey, buf.fill(None, dkey), None, None)
    assert dbatch.num_decode_rows == 4 and dbatch.q_starts.tolist() == [0, 1, 2, 3]
    dbatch.check()


def test_padded_rows_too_long_for_the_page_table_are_refused():
    with pytest.raises(AssertionError, match="dummy-page"):
        StaticBuffers.allocate(4, 1, 2, CPU, tokens_per_row=(1, 4))  # needs 2 references


@pytest.mark.parametrize(
    "k,ps,prefix_lens",
    [(1, 4, [1, 6, 3]), (3, 4, [2, 5, 9]), (3, 2, [1, 4, 3]), (3, 4, [7])],
)
def test_static_verify_replay_equals_eager(tiny_model_dirs, k, ps, prefix_lens):
    """Rows of different prefix lengths, batch padded 3 -> 4 (or 1 -> 2), a KV pool of
    just the pages the rows need plus the dummy page: every scored token's logits
    through the static buffers equal the eager forward's and a PREFILL of the whole
    rows'."""
    need = sum(-(-(n + k + 1) // ps) for n in prefix_lens)
    ex, context = build_executor(
        tiny_model_dirs["llama"],
        device="cpu",
        dtype="float32",
        page_size=ps,
        num_kv_pages=need + 1,
        static_graph_replay=True,
        cuda_graph_max_bs=4,
        cuda_graph_bs="2,4",
    )
    assert ex.graphs is not None and {key.mode for key in ex.graphs.keys} == {D}  # the default
    ex.setup_graphs(context, verify_tokens_per_row=k + 1)  # static capture on padding rows
    assert sorted(key for key in ex.graphs.keys if key.mode == V) == [
        GraphKey(V, 2, k + 1),
        GraphKey(V, 4, k + 1),
    ]
    case = make_case(ex, prefix_lens, k, seed=k + ps)
    prefill_prefixes(ex, case)
    eager = verify(ex, case, graphs=False)
    runs = ex.graphs.num_runs
    replay = verify(ex, case, graphs=True)
    assert ex.graphs.num_runs == runs + 1, "the VERIFY step went through the graph runner"
    bs = len(prefix_lens)
    padded = 4 if bs == 3 else 2  # the padding rows of this replay: k + 1 tokens, dummy page
    assert ex.graphs.buf.seq_lens[bs:padded].tolist() == [k + 1] * (padded - bs)
    assert (ex.graphs.buf.page_table[bs:padded] == DUMMY_PAGE).all()
    assert eager.argmax is None and replay.argmax is not None
    n = len(prefix_lens) * (k + 1)
    assert replay.logits.shape == eager.logits.shape == (n, ex.cfg.vocab_size)
    torch.testing.assert_close(replay.logits, eager.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(replay.argmax, eager.logits.argmax(-1))
    torch.testing.assert_close(whole_row_logits(ex, case), eager.logits, atol=1e-5, rtol=1e-5)


def test_decode_graphs_still_serve_decode_beside_verify(tiny_model_dirs):
    """With VERIFY graphs added, a DECODE step still replays its own key (one token per
    row) and equals eager."""
    ex, context = build_executor(
        tiny_model_dirs["llama"],
        device="cpu",
        dtype="float32",
        page_size=4,
        num_kv_pages=8,
        static_graph_replay=True,
        cuda_graph_max_bs=4,
    )
    ex.setup_graphs(context, verify_tokens_per_row=3)
    case = make_case(ex, [3, 6, 1], k=0)  # one token per row: a decode step
    prefill_prefixes(ex, case)
    rows = [RowInput(len(p), d, pg) for p, d, pg in zip(case.prefixes, case.drafts, case.pages)]
    bt = build_batch_tensors(rows, ex.page_size, CPU)
    assert ex.graphs.can_run(D, bt) and not ex.graphs.can_run(V, bt)
    every = torch.arange(3)
    with torch.inference_mode():
        replay = ex.forward(D, bt, every, every_token=True)
        graphs, ex.graphs = ex.graphs, None
        eager = ex.forward(D, bt, every, every_token=True)
        ex.graphs = graphs
    torch.testing.assert_close(replay.logits, eager.logits, atol=1e-5, rtol=1e-5)
