"""Start-up warm-up: each kind of step runs once, on the dummy page only, and leaves
no request state behind."""

import pytest
import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.worker.bootstrap import build_worker
from gyrfalcon.worker.warmup import (
    WARMUP_CHUNK,
    WARMUP_RIDS,
    prompt_chunks,
    warmup_batches,
    warmup_chunk,
    warmup_last_position,
)


@pytest.mark.parametrize("k", [0, 3])
def test_plans_give_every_request_the_pages_its_tokens_need(k):
    """Rows continue where the last ended (a verify row as if it accepted nothing); with
    a drafter the decodes verify k drafts, greedy beside sampled, then greedy alone."""
    ps = 16
    batches = warmup_batches(ps, chunk=24, num_draft=k)
    decodes = [ForwardMode.VERIFY] * 2 if k else [ForwardMode.DECODE]
    assert [b.forward_mode for b in batches] == [
        ForwardMode.PREFILL, ForwardMode.PREFILL, ForwardMode.MIXED, *decodes, ForwardMode.IDLE,
    ]  # fmt: skip
    pages = {rid: 0 for rid in WARMUP_RIDS}
    computed = {rid: 0 for rid in WARMUP_RIDS}
    for batch in batches:
        for row in batch.rows:
            assert row.start == computed[row.rid], "rows continue where the last one ended"
            assert set(row.new_pages) <= {DUMMY_PAGE}
            assert row.num_draft == (k if len(row.input_ids) == 1 else 0)
            pages[row.rid] += len(row.new_pages)
            assert pages[row.rid] == -(
                -(computed[row.rid] + len(row.input_ids) + row.num_draft) // ps
            )
            computed[row.rid] += len(row.input_ids)
    assert sorted(batches[-1].finished_rids) == sorted(WARMUP_RIDS)
    assert [r.rid for b in batches for r in b.new_requests] == list(WARMUP_RIDS)
    mixed = batches[2].rows
    assert len(mixed[0].input_ids) == 1 and len(mixed[1].input_ids) > 1  # decode rows lead


@pytest.mark.parametrize("static", [False, True])
def test_warm_up_touches_only_the_dummy_page(tiny_model_dirs, static):
    d = tiny_model_dirs["llama"]
    args = ServerArgs(
        model=d, device="cpu", dtype="float32", page_size=4, num_kv_pages=32,
        static_graph_replay=static,
    ).resolved()  # fmt: skip
    runner, _ = build_worker(args, d, ModelConfig.from_dir(d), rank=0)  # warms up
    kv = runner.executor.kv_cache
    ps = args.page_size
    dummy = slice(DUMMY_PAGE * ps, (DUMMY_PAGE + 1) * ps)
    assert kv.k[:, dummy].abs().sum() > 0 and kv.v[:, dummy].abs().sum() > 0  # the steps ran
    rest = torch.ones(kv.k.shape[1], dtype=torch.bool)
    rest[dummy] = False
    assert not kv.k[:, rest].any() and not kv.v[:, rest].any()
    assert not runner.requests and not runner.pending
    assert runner.requests.num_free_slots == runner.requests.last_tokens.shape[0]  # every slot back


@pytest.mark.parametrize("k", [0, 1, 3])
def test_plans_stay_within_their_last_position(k):
    for chunk in (1, 4, 24):
        ends = [
            row.start + len(row.input_ids) + row.num_draft
            for batch in warmup_batches(4, chunk, k)
            for row in batch.rows
        ]
        first, second, _ = prompt_chunks(chunk)
        expect = first + second + (2 + k if k else 1)
        assert max(ends) - 1 == warmup_last_position(chunk, k) == expect


@pytest.mark.parametrize("k", [0, 3])
def test_chunk_is_the_largest_that_fits_the_context(k):
    assert warmup_chunk(10_000, k) == WARMUP_CHUNK
    for context in (3, 8, 20, 61, 64):
        c = warmup_chunk(context, k)
        assert c == 0 or warmup_last_position(c, k) < context
        assert c == WARMUP_CHUNK or warmup_last_position(c + 1, k) >= context


def test_prompt_rows_meet_short_middling_and_long_query_blocks():
    """Triton's extend kernel builds once per query block size (16, 32, 64 by the
    longest row): the warm-up's prompt rows meet each."""
    from gyrfalcon.kernels.attention_extend import extend_block_sizes

    blocks = {extend_block_sizes(n, 64)[0] for n in prompt_chunks(WARMUP_CHUNK)}
    assert blocks == {16, 32, 64}


def test_spec_warm_up_touches_only_the_dummy_page_of_target_and_drafter(tmp_path):
    """With a drafter the warm-up verifies drafts (general path and fused step) and
    drafts after every row; every page it writes, the target's and the drafter's, is
    the dummy page, and nothing is left behind."""
    from spec_util import engine, make_pair

    target, draft = make_pair(tmp_path)
    eng = engine(target, draft, static_graph_replay=True)
    w = eng.worker
    assert w.fused is not None
    for kv in (w.executor.kv_cache, w.drafter.kv_cache):
        ps = kv.page_size
        dummy = slice(DUMMY_PAGE * ps, (DUMMY_PAGE + 1) * ps)
        assert kv.k[:, dummy].abs().sum() > 0
        rest = torch.ones(kv.k.shape[1], dtype=torch.bool)
        rest[dummy] = False
        assert not kv.k[:, rest].any() and not kv.v[:, rest].any()
    assert not w.requests and not w.pending


@pytest.mark.parametrize("context,runs", [(10, True), (3, False)])
def test_warm_up_fits_a_short_context(tiny_model_dirs, context, runs):
    d = tiny_model_dirs["llama"]
    args = ServerArgs(
        model=d, device="cpu", dtype="float32", page_size=4, num_kv_pages=32,
        max_model_len=context, static_graph_replay=True,
    ).resolved()  # fmt: skip
    runner, ctx = build_worker(args, d, ModelConfig.from_dir(d), rank=0)
    assert ctx == context
    # its decode step and the IDLE drop's dummy row replay; too short: none
    assert runner.executor.graphs.num_runs == 2 * int(runs)
    assert not runner.requests


def test_eager_rows_are_the_row_counts_no_graph_serves():
    """The warm-up builds eager DECODE rows' kernels for exactly these (worker/
    warmup.warm_up_roles): every count without graphs, those past the largest
    graph of that mode with them."""
    from gyrfalcon.worker.warmup import eager_rows

    class Graphs:  # a runner whose DECODE graphs hold up to 8 rows
        @staticmethod
        def largest(mode):
            return 8 if mode == ForwardMode.DECODE else 0

    assert eager_rows(None, ForwardMode.DECODE, 32) == range(1, 33)
    assert eager_rows(Graphs, ForwardMode.DECODE, 32) == range(9, 33)
    assert eager_rows(Graphs, ForwardMode.DRAFT_DECODE, 32) == range(1, 33)
    assert not eager_rows(Graphs, ForwardMode.DECODE, 8)
