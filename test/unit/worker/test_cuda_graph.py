"""Graph padding logic through static-buffer replay (CPU): same function, static
buffers, padded batch sizes; greedy output must equal eager output exactly."""

import pytest
import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode, SamplingParams
from gyrfalcon.worker.cuda_graph import capture_batch_sizes, padded_batch_size
from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers


def test_capture_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(32)[-3:] == [16, 24, 32]
    assert capture_batch_sizes(16, [4, 2, 64]) == [2, 4, 16]


def test_padded_batch_size():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        padded_batch_size(17, sizes)


def test_fill_pads_with_dummy_page_and_length_one():
    buf = StaticBuffers.allocate(8, 4, 4, torch.device("cpu"))
    bt = build_batch_tensors(
        [RowInput(5, [11], [3, 7]), RowInput(0, [12], [2])], 4, torch.device("cpu")
    )
    # dirty the buffers as an earlier, larger replay would have
    buf.input_ids.fill_(99)
    buf.page_table.fill_(5)
    lens = buf.fill(bt, GraphKey(ForwardMode.DECODE, 4, 1))
    assert lens == [6, 1, 1, 1]
    assert buf.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert buf.positions[:4].tolist() == [5, 0, 0, 0]
    assert buf.out_cache_loc[:4].tolist() == [29, 8, 0, 0]
    assert buf.seq_lens[:4].tolist() == [6, 1, 1, 1]
    assert buf.page_table[2:4].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert buf.page_table[0, :2].tolist() == [3, 7]


def test_fill_after_fill_of_other_sizes_writes_each_step_whole():
    """Steps of other row counts and table widths in turn through the kept views: rows
    a larger step left real are padding again, and a wider table's columns never leak
    into a narrower step's rows (only the dummy page or the row's pages)."""
    cpu = torch.device("cpu")
    buf = StaticBuffers.allocate(8, 4, 4, cpu)
    big = build_batch_tensors(
        [RowInput(9, [11], [3, 7, 2]), RowInput(4, [12], [6, 1]), RowInput(0, [13], [5])], 4, cpu
    )
    small = build_batch_tensors([RowInput(2, [21], [4])], 4, cpu)
    key = GraphKey(ForwardMode.DECODE, 4, 1)
    for _ in range(2):
        assert buf.fill(big, key) == [10, 5, 1, 1]
        assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
        assert buf.positions[:4].tolist() == [9, 4, 0, 0]
        assert buf.out_cache_loc[:4].tolist() == [2 * 4 + 1, 1 * 4, 5 * 4, 0]
        assert buf.page_table[:4, :3].tolist() == [[3, 7, 2], [6, 1, 0], [5, 0, 0], [0, 0, 0]]
        assert buf.fill(small, key) == [3, 1, 1, 1]
        assert buf.input_ids[:4].tolist() == [21, 0, 0, 0]
        assert buf.positions[:4].tolist() == [2, 0, 0, 0]
        assert buf.out_cache_loc[:4].tolist() == [4 * 4 + 2, 0, 0, 0]
        assert buf.seq_lens[:4].tolist() == [3, 1, 1, 1]
        assert buf.page_table[1:4].tolist() == [[0] * 4] * 3
    assert len(buf._views) == 4  # two steps' rows and padding, made once each


def run(model_dir, prompts, sampling, **kw):
    args = ServerArgs(model=model_dir, device="cpu", dtype="float32", page_size=4, **kw)
    eng = LocalEngine(args, model_dir)
    out = eng.generate(prompts, sampling)
    eng.check_integrity()
    return eng, out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_replay_equals_eager_for_every_padding(tiny_model_dirs, arch):
    d = tiny_model_dirs[arch]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 4, 13, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    _, eager = run(d, prompts, greedy, num_kv_pages=64)
    # capture sizes 2 and 4 (and max 8): 5 rows pad to 8, 3 rows to 4, 1 row to 2
    eng, replay = run(
        d,
        prompts,
        greedy,
        num_kv_pages=64,
        static_graph_replay=True,
        cuda_graph_max_bs=8,
        cuda_graph_bs="2,4",
    )
    assert eng.worker.executor.graphs is not None and eng.worker.executor.graphs.sizes == [2, 4, 8]
    assert eng.worker.executor.graphs.num_runs >= 9  # every decode step went through it
    assert replay == eager
    # the dummy page absorbed every padding write; no real page was touched by padding
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_static_capture_with_tiny_kv_pool(tiny_model_dirs):
    """Capture needs no KV capacity beyond the dummy page (3 pages in all here)."""
    d = tiny_model_dirs["llama"]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _, out = run(
        d, [[5, 6, 7]], greedy, num_kv_pages=3, static_graph_replay=True, cuda_graph_max_bs=16
    )
    _, ref = run(d, [[5, 6, 7]], greedy, num_kv_pages=3)
    assert out == ref


def test_seeded_sampling_is_unchanged_by_padding(tiny_model_dirs):
    d = tiny_model_dirs["llama"]
    sp = SamplingParams(temperature=1.0, seed=17, max_tokens=8, ignore_eos=True)
    _, eager = run(d, [[4, 5, 6], [9, 8]], sp, num_kv_pages=32)
    _, replay = run(
        d, [[4, 5, 6], [9, 8]], sp, num_kv_pages=32, static_graph_replay=True, cuda_graph_max_bs=4
    )
    assert replay == eager
