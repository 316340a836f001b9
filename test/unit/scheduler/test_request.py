"""The token-accounting index math of request.py: pure functions, checked alone."""

from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.scheduler.request import (
    Request,
    cut_at_finish,
    draft_slots,
    kv_end,
    stop_reason,
)

EOS = 99


def test_kv_end_covers_inputs_then_drafts():
    assert kv_end(10, 1) == 11  # a decode row
    assert kv_end(10, 1, 3) == 14  # a verify row: [last token, d1, d2, d3]
    assert kv_end(0, 7) == 7  # a prefill chunk


def test_draft_slots_never_exceed_what_may_still_be_kept():
    assert draft_slots(3, 10) == 3
    assert draft_slots(3, 4) == 3  # 3 drafts + 1 target token == 4 tokens left
    assert draft_slots(3, 2) == 1
    assert draft_slots(3, 1) == 0  # only the target's token may still come
    assert draft_slots(0, 10) == 0


def test_stop_reason_order_and_min_tokens():
    sp = SamplingParams(max_tokens=5, stop_token_ids=[42], min_tokens=2)
    args = ((EOS,), 100)
    assert stop_reason(sp, 7, 1, 10, *args) is None
    assert stop_reason(sp, 42, 2, 11, *args) is None  # min_tokens: a stop id cannot end it
    assert stop_reason(sp, EOS, 2, 11, *args) is None
    assert stop_reason(sp, 42, 3, 12, *args) == "stop"
    assert stop_reason(sp, EOS, 3, 12, *args) == "stop"
    assert stop_reason(sp, 7, 5, 14, *args) == "length"  # max_tokens
    assert stop_reason(sp, 7, 3, 100, *args) == "length"  # the context is full
    assert stop_reason(SamplingParams(ignore_eos=True), EOS, 1, 3, *args) is None


def request(n_out=0, **sp):
    req = Request("r", [1, 2, 3], SamplingParams(**sp), 0)
    req.output_ids = [5] * n_out
    return req


def test_cut_at_finish_keeps_every_token_without_a_finish():
    assert cut_at_finish(request(), [7, 8, 9], (EOS,), 100) == (3, None)


def test_cut_at_finish_stops_inside_an_accepted_run():
    # EOS second of four emitted tokens: the two after it are dropped
    assert cut_at_finish(request(), [7, EOS, 8, 9], (EOS,), 100) == (2, "stop")
    assert cut_at_finish(request(stop_token_ids=[8]), [7, 8, 8], (EOS,), 100) == (2, "stop")


def test_cut_at_finish_at_max_tokens_and_context_length_mid_run():
    assert cut_at_finish(request(n_out=2, max_tokens=4), [7, 8, 9], (EOS,), 100) == (2, "length")
    # prompt 3 + 2 outputs: position 6 is the last the context (7) holds
    assert cut_at_finish(request(n_out=2), [7, 8, 9], (EOS,), 7) == (2, "length")


def test_cut_at_finish_counts_min_tokens_across_the_run():
    # two outputs known; min_tokens 3: the first emitted EOS is output 3 (masked), the next
    # is output 4 and ends it
    req = request(n_out=2, min_tokens=3)
    assert cut_at_finish(req, [EOS, EOS, 7], (EOS,), 100) == (2, "stop")


def test_tokens_slice_placeholders_stand_for_tokens_in_flight():
    req = request(n_out=1)
    req.num_pending = 1
    assert req.tokens_slice(3, 5) == [5, PLACEHOLDER]
    assert req.tokens_left(100) == 16 - 2 and req.tokens_left(6) == 1


def test_tokens_slice_is_the_known_tokens_then_placeholders_for_every_slice():
    # prompt [1, 2, 3], outputs [4, 5], two tokens in flight: every [start, end) a row may
    # ask for (prompt chunks, a recompute across prompt and outputs, decodes)
    req = request()
    req.output_ids, req.num_pending = [4, 5], 2
    tokens = req.prompt_ids + req.output_ids + [PLACEHOLDER] * 2
    for start in range(len(tokens)):
        for end in range(start + 1, len(tokens) + 1):
            assert req.tokens_slice(start, end) == tokens[start:end], (start, end)
