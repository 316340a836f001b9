"""Piecewise graphs (worker/piecewise_graph.py) on the CPU through static replay: the
captured sizes, greedy outputs equal to HF's with prefill chunks and mixed steps
running padded between eager attention calls, and padding that writes the dummy page
only."""

import pytest
import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.contract import DUMMY_PAGE, piecewise_sizes
from gyrfalcon.ipc.messages import (
    ForwardMode,
    NewRequest,
    RankBatch,
    SamplingParams,
    ScheduledRow,
    StepPlan,
)
from gyrfalcon.worker.bootstrap import build_worker
from gyrfalcon.worker.cuda_graph import padded_batch_size

PS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def args(model_dir: str, **kw) -> ServerArgs:
    return ServerArgs(
        model=model_dir, device="cpu", dtype="float32", page_size=PS, static_graph_replay=True,
        piecewise_cuda_graph_max_tokens=16, **kw,
    )  # fmt: skip


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0,
                       attention_mask=torch.ones_like(ids))  # fmt: skip
        outs.append(g[0, len(p) :].tolist())
    return outs


def test_sizes_pad_at_most_one_and_a_half_times_above_64_tokens_and_an_eighth_above_1024():
    assert piecewise_sizes(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert piecewise_sizes(100) == [16, 32, 64, 96, 100]
    assert piecewise_sizes(8) == [8] and piecewise_sizes(0) == []
    assert piecewise_sizes(2304)[9:] == [768, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920,
                                         2048, 2304]  # fmt: skip
    sizes = piecewise_sizes(8448)
    assert all(b <= 1.5 * a for a, b in zip(sizes[2:], sizes[3:]))
    big = [s for s in sizes if s >= 1024]
    assert all(b <= 1.125 * a for a, b in zip(big, big[1:])) and len(sizes) == 36
    assert [padded_batch_size(n, sizes) for n in (1, 16, 17, 65, 1092, 8448)] == [
        16, 16, 32, 96, 1152, 8448,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="exceed"):
        padded_batch_size(8449, sizes)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_and_mixed_steps_through_pieces_match_hf(tiny_model_dirs, arch):
    """Chunks of 8 and mixed steps of up to 11 tokens run padded to 16 between eager
    attention calls; the 30-token prompt's step beside decodes (too large) runs eagerly;
    greedy outputs are HF's token for token."""
    d = tiny_model_dirs[arch]
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 9, 30)]
    eng = LocalEngine(args(d, num_kv_pages=64, chunked_prefill_size=8), d)
    warm_up_runs = eng.worker.executor.piecewise.num_runs  # its short prompt row's steps
    assert eng.generate(ps, GREEDY) == hf_greedy(d, ps, GREEDY.max_tokens)
    kinds = eng.worker.stats.kinds
    assert kinds["piecewise"].steps > 0 and kinds["graph"].steps > 0
    assert eng.worker.executor.piecewise.num_runs - warm_up_runs == kinds["piecewise"].steps
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_padding_tokens_write_the_dummy_page_only(tiny_model_dirs):
    """A 5-token prompt padded to 16: its KV lands in its own slots and nowhere else but
    the dummy page's first slot (where a GPU's pieces, which write the cache with
    rotary, store the 11 padding tokens'; the CPU writes it in the eager attention, for
    the real tokens only)."""
    d = tiny_model_dirs["llama"]
    w = build_worker(args(d, num_kv_pages=32).resolved(), d, ModelConfig.from_dir(d), rank=0)[0]
    kv = w.executor.kv_cache
    kv.k.zero_()
    kv.v.zero_()
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [5, 6, 7, 8, 9]
    row = ScheduledRow("r", 0, prompt, [3, 4], True)
    w.execute(StepPlan(0, [RankBatch(ForwardMode.PREFILL, [row], [NewRequest("r", prompt, sp)])]))
    assert w.stats.kinds["piecewise"].steps == 1
    written = (kv.k.abs().sum(dim=(0, 2, 3)) > 0) | (kv.v.abs().sum(dim=(0, 2, 3)) > 0)
    want = torch.zeros_like(written)
    want[[3 * PS + i for i in range(PS)] + [4 * PS]] = True  # positions 0 .. 4
    written[DUMMY_PAGE * PS] = False
    assert torch.equal(written, want)
