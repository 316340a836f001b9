"""The largest step's memory: the profile's steps (the most tokens a step can hold, then
the most logit rows), the KV budget that keeps their peak free, and the steps run
through a worker without touching anything but the dummy page."""

import pytest
import torch

from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode, SamplingParams
from gyrfalcon.worker.kv_sizing import SLACK_BYTES, kv_budget, kv_page_bytes, pages_for_shortfall
from gyrfalcon.worker.memory_profile import (
    FIT_MARGIN_BYTES,
    agreed_shortfall,
    check_largest_step_fits,
    fit_kv_cache,
    run_profile_steps,
    step_peak_bytes,
)
from gyrfalcon.worker.warmup import profile_batches, profile_rows

GIB = 1 << 30


@pytest.mark.parametrize(
    "budget, max_seqs, chunk, longest, want",
    [
        (16384, 256, 8192, 10**6, [64] * 256),  # the CUDA defaults: every row, every token
        (16384, 1, 8192, 10**6, [8192]),  # one row: a chunk at most
        (10, 4, 8, 100, [3, 3, 2, 2]),
        (3, 8, 8, 100, [1, 1, 1]),  # no more rows than tokens
        (100, 4, 8, 5, [5, 5, 5, 5]),  # the context bounds a row
    ],
)
def test_profile_rows_fill_the_step(budget, max_seqs, chunk, longest, want):
    assert profile_rows(budget, max_seqs, chunk, longest) == want


@pytest.mark.parametrize("k", [0, 3])
def test_profile_batches_prefill_every_row_then_verify_every_row(k):
    ps, context = 16, 200
    batches = profile_batches(ps, 1000, 12, 64, context, k)
    prefill, decode, drop = batches
    assert [b.forward_mode for b in batches] == [
        ForwardMode.PREFILL, ForwardMode.VERIFY if k else ForwardMode.DECODE, ForwardMode.IDLE,
    ]  # fmt: skip
    lengths = [len(r.input_ids) for r in prefill.rows]
    assert lengths == profile_rows(1000, 12, 64, context - 2 - k) and sum(lengths) == 768
    assert [len(n.prompt_ids) for n in prefill.new_requests] == lengths
    assert all(r.sample and r.start == 0 for r in prefill.rows)
    for p, d in zip(prefill.rows, decode.rows):
        assert d.rid == p.rid and d.start == len(p.input_ids) and d.num_draft == k and d.sample
        held = len(p.new_pages) + len(d.new_pages)
        assert held == -(-(d.start + 1 + k) // ps)  # pages cover the drafts' positions too
        assert d.start + k < context
    pages = {pg for b in batches for r in b.rows for pg in r.new_pages}
    assert pages == {DUMMY_PAGE}
    assert sorted(drop.finished_rids) == sorted(r.rid for r in prefill.rows)
    assert all(not n.sampling.greedy for n in prefill.new_requests)


def test_a_context_too_short_for_a_profile_row_profiles_nothing():
    assert profile_batches(16, 1000, 12, 64, 5, 3) == []
    assert len(profile_batches(16, 1000, 12, 64, 6, 3)) == 3


def test_kv_budget_keeps_the_largest_step_free():
    total, free = 80 * GIB, 60 * GIB  # 20 GiB resident
    assert kv_budget(total, free, 0.85) == (48 * GIB, False)  # no peak measured: the fraction
    assert kv_budget(total, free, 0.85, 2 * GIB) == (48 * GIB, False)  # fits beside
    budget, capped = kv_budget(total, free, 0.85, 16 * GIB)
    assert capped and budget == free - 16 * GIB - SLACK_BYTES
    assert kv_budget(total, free, 0.85, 70 * GIB) == (0, True)
    # 2 GiB more came to stay in the measuring run (20 GiB resident before it): the
    # fraction still counts from the 20, while the step's room counts from what is free
    assert kv_budget(total, free - 2 * GIB, 0.85, 2 * GIB, 20 * GIB) == (48 * GIB, False)
    budget, capped = kv_budget(total, free - 2 * GIB, 0.85, 12 * GIB, 20 * GIB)
    assert capped and budget == free - 2 * GIB - 12 * GIB - SLACK_BYTES


@pytest.mark.parametrize("with_drafter", [False, True])
def test_profile_steps_touch_only_the_dummy_page_and_change_no_answer(tmp_path, with_drafter):
    """The profile's steps (every sampling feature on, verify rows when drafting) run
    through the worker between requests: nothing but the dummy page is written, nothing
    is left behind, and later greedy answers are what they were."""
    from spec_util import engine, make_pair, run

    target, draft = make_pair(tmp_path)
    eng = engine(
        target, draft if with_drafter else None, static_graph_replay=True,
        max_num_batched_tokens=48, max_num_seqs=6, chunked_prefill_size=16,
    )  # fmt: skip
    prompts = [[5, 9, 17, 33], [7] * 9]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = run(eng, prompts, greedy)
    w = eng.worker
    caches = [w.executor.kv_cache] + ([w.drafter.kv_cache] if with_drafter else [])
    snapshots = [(kv.k.clone(), kv.v.clone()) for kv in caches]
    run_profile_steps(w, w.max_model_len)
    for kv, (k0, v0) in zip(caches, snapshots):
        ps = kv.page_size
        rest = torch.ones(kv.k.shape[1], dtype=torch.bool)
        rest[DUMMY_PAGE * ps : (DUMMY_PAGE + 1) * ps] = False
        assert torch.equal(kv.k[:, rest], k0[:, rest]) and torch.equal(kv.v[:, rest], v0[:, rest])
    assert not w.requests and not w.pending
    assert run(eng, prompts, greedy).ids == before.ids


def test_a_largest_step_that_does_not_fit_fails_with_what_to_change(tiny_model_dirs, monkeypatch):
    from gyrfalcon.config.model_config import ModelConfig
    from gyrfalcon.config.server_args import ServerArgs
    from gyrfalcon.worker.bootstrap import build_worker

    d = tiny_model_dirs["llama"]
    args = ServerArgs(model=d, device="cpu", dtype="float32", page_size=4, num_kv_pages=32)
    worker, context = build_worker(args.resolved(), d, ModelConfig.from_dir(d), rank=0)

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(worker, "submit_batch", out_of_memory)
    with pytest.raises(
        RuntimeError, match="does not fit beside the KV cache: lower --mem-fraction"
    ):
        check_largest_step_fits(worker, context)
    # where the measured peak is known and more than is free, it says so before running
    worker.step_peak = 3 * GIB - FIT_MARGIN_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(RuntimeError, match=r"needs 3.00 GiB; 1.00 GiB are free .* lower --mem"):
        check_largest_step_fits(worker, context)


def eagle3_pair(tmp_path):
    """(target dir, resolved args, target config) of a tiny EAGLE3 pair (k = 3) on the
    CPU under static graph replay, with profile budgets of 40 tokens over 5 rows."""
    from spec_util import make_pair

    from gyrfalcon.config.model_config import ModelConfig
    from gyrfalcon.config.server_args import ServerArgs

    target, draft = make_pair(tmp_path)
    args = ServerArgs(
        model=target, device="cpu", dtype="float32", page_size=4, num_kv_pages=64,
        speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
        speculative_num_steps=3, max_num_batched_tokens=40, max_num_seqs=5,
        chunked_prefill_size=16, static_graph_replay=True,
    ).resolved()  # fmt: skip
    return target, args, ModelConfig.from_dir(target)


def test_the_measuring_run_goes_before_the_kv_cache_and_leaves_nothing(tmp_path):
    """What KV sizing runs first (CUDA measures it; here it runs unmeasured): the
    profile's steps, drafter included, eagerly on a cache of two pages, before any graph
    or fused step exists; then the cache is gone and the worker sizes and starts as
    usual, answering like a worker that never measured."""
    from gyrfalcon.worker.step_worker import StepWorker

    target, args, cfg = eagle3_pair(tmp_path)
    outputs = []
    for measure in (True, False):
        w = StepWorker(args, cfg, target)
        if measure:
            assert step_peak_bytes(w, 200) == 0  # not measured on the CPU
            assert w.executor.kv_cache is None and w.drafter.kv_cache is None
            assert w.executor.graphs is None and w.fused is None
            assert not w.requests and not w.pending and w.max_model_len == 0
        w.init_kv_cache(64, 200)
        w.warm_up(200)
        batches = profile_batches(4, 40, 5, 16, 200, 3)  # any steps: the profile's own
        torch.manual_seed(0)  # NOTE: their rows sample unseeded
        got = []
        for i, rb in enumerate(batches):
            w.submit_batch(i, rb)
            got.append([r.token_ids for r in w.take().rows])
        outputs.append(got)
    assert outputs[0] == outputs[1]


def test_a_shortfall_comes_out_of_the_kv_cache_in_whole_pages():
    assert pages_for_shortfall(100, 250, 100) == 97  # 2.5 pages short: 3 pages go
    assert pages_for_shortfall(100, 300, 100) == 97
    assert pages_for_shortfall(3, 1, 100) == 2  # the dummy page and one
    with pytest.raises(RuntimeError, match="no room for a KV cache.*--max-num-batched-tokens"):
        pages_for_shortfall(3, 101, 100)


def test_ranks_that_share_collectives_agree_on_the_largest_shortfall(monkeypatch):
    """Every rank of the MoE group captures again or none does: a rank that captured
    alone would wait in its graphs' collectives for ranks that never come."""
    from types import SimpleNamespace

    from parallel_util import ThreadGroup, ThreadGroupMember, run_ranks

    from gyrfalcon.forward.parallel import ParallelContext
    from gyrfalcon.worker import memory_profile

    monkeypatch.setattr(memory_profile, "memory_shortfall", lambda w, margin=0: w.step_peak)
    group = ThreadGroup(2)
    mine = [0, 5 * GIB]  # rank 1 is short, rank 0 is not

    def rank(r: int) -> int:
        ctx = SimpleNamespace(parallel=ParallelContext(r, 2, ThreadGroupMember(group, r)))
        worker = SimpleNamespace(
            step_peak=mine[r], device=torch.device("cpu"), executor=SimpleNamespace(ctx=ctx)
        )
        return agreed_shortfall(worker)

    assert run_ranks(rank, 2) == [5 * GIB, 5 * GIB]


def test_a_shortfall_shrinks_the_cache_and_captures_again(tmp_path):
    """Where the graphs leave less free than the largest step needs, the cache gives up
    the shortfall in whole pages (the drafter's with the target's), the old caches and
    graphs are gone, new ones are captured over the smaller cache, and the worker answers
    like one sized that small from the start."""
    import gc
    import weakref

    from gyrfalcon.worker.step_worker import StepWorker

    target, args, cfg = eagle3_pair(tmp_path)
    batches = profile_batches(4, 40, 5, 16, 200, 3)

    def answers(w: StepWorker) -> list:
        for kv in (w.executor.kv_cache, w.drafter.kv_cache):  # NOTE: the rows' only page
            dummy = slice(DUMMY_PAGE * kv.page_size, (DUMMY_PAGE + 1) * kv.page_size)
            kv.k[:, dummy] = 0
            kv.v[:, dummy] = 0
        torch.manual_seed(0)  # NOTE: the profile's rows sample unseeded
        got = []
        for i, rb in enumerate(batches):
            w.submit_batch(i, rb)
            got.append([r.token_ids for r in w.take().rows])
        return got

    outputs = []
    for pages in (64, 53):
        w = StepWorker(args, cfg, target)
        w.init_kv_cache(pages, 200)
        w.warm_up(200)
        if pages == 64:
            ex, drafter = w.executor, w.drafter
            old = [weakref.ref(x) for x in (ex.kv_cache, drafter.kv_cache, ex.graphs, w.fused)]
            per_page = kv_page_bytes(args, cfg, ex.dtype, 1, drafter.cfg.layer)
            fit_kv_cache(w, short=10 * per_page + 1)  # 10 pages and a byte: 11 pages go
            gc.collect()
            assert all(r() is None for r in old), "an old cache or graph is still referenced"
            assert ex.kv_cache.num_pages == drafter.kv_cache.num_pages == 53
            assert ex.graphs.kv_cache is ex.kv_cache and drafter.graphs.kv_cache is drafter.kv_cache
            assert w.fused is not None
            assert w.max_model_len == 200  # 52 usable pages of 4 still hold the context
            fit_kv_cache(w, short=0)  # nothing short: nothing changes
            assert ex.kv_cache.num_pages == 53
        outputs.append(answers(w))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "free_beyond_peak, want",
    [
        (3 * FIT_MARGIN_BYTES, 0),  # room for the check and more: nothing to give up
        (FIT_MARGIN_BYTES + 1, 0),  # the check passes: no capture again for a few MiB
        (FIT_MARGIN_BYTES - 1, FIT_MARGIN_BYTES + 1),  # short: give up up to twice the margin
        (-GIB, GIB + 2 * FIT_MARGIN_BYTES),
    ],
)
def test_a_rank_captures_again_only_where_the_check_would_fail(monkeypatch, free_beyond_peak, want):
    from types import SimpleNamespace

    from gyrfalcon.forward.parallel import SINGLE_RANK

    peak = 4 * GIB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (peak + free_beyond_peak, 80 * GIB))
    ctx = SimpleNamespace(parallel=SINGLE_RANK)
    worker = SimpleNamespace(
        step_peak=peak, device=torch.device("cpu"), executor=SimpleNamespace(ctx=ctx)
    )
    assert agreed_shortfall(worker) == want


def test_the_measuring_run_reports_what_it_left_in_use(monkeypatch):
    """What `--mem-fraction` counts from is what was in use before the run; what the run
    left behind is logged by where it lies (tensors, torch's cache, outside torch)."""
    from types import SimpleNamespace

    from gyrfalcon.worker import memory_profile

    state = {"free": 60 * GIB, "alloc": 16 * GIB, "res": 16 * GIB}

    def run(worker, context_len):  # leaves 1 GiB of tensors, 0.5 cached, 0.25 elsewhere
        state.update(free=state["free"] - int(1.75 * GIB), alloc=17 * GIB, res=int(17.5 * GIB))
        return 5 * GIB

    monkeypatch.setattr(memory_profile, "step_peak_bytes", run)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _: state["alloc"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _: state["res"])
    logged: list[str] = []  # NOTE: not caplog: other tests' logging set-up may stop propagation
    monkeypatch.setattr(memory_profile.logger, "info", lambda fmt, *a: logged.append(fmt % a))
    worker = SimpleNamespace(device=torch.device("cpu"), step_peak=0)
    assert memory_profile.measure_largest_step(worker, 100) == (5 * GIB, 20 * GIB)
    assert worker.step_peak == 5 * GIB
    want = "left 1.75 GiB in use: 1.00 GiB of tensors, 0.50 GiB cached beside them, 0.25"
    assert len(logged) == 1 and want in logged[0], logged
