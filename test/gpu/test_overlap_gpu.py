"""Overlap scheduling on the GPU: no host sync while a step is launched; same tokens.

The host may only wait for the device where it reads sampled ids (an event,
in HostCopy.wait); any other synchronization would serialize the planning of
step N+1 behind the kernels of step N.
"""

import pytest
import torch

from gyrfalcon.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize(
    "backend,decode,dtype,eager",
    [
        ("flashinfer", "flashinfer", "bfloat16", False),
        ("flashinfer", "flashinfer", "bfloat16", True),
        ("flashinfer", "triton", "bfloat16", False),  # the default above a launch-bound size
        ("triton", "triton", "float32", False),
        ("triton", "triton", "bfloat16", True),
    ],
)
def test_steps_launch_without_host_sync(tiny_gpu_dir, gpu_engine, backend, decode, dtype, eager):
    eng = gpu_engine(
        tiny_gpu_dir,
        backend,
        dtype,
        enforce_eager=eager,
        cuda_graph_max_bs=16,
        decode_attention_backend=decode,
    )
    assert (eng.worker.executor.attn.name, eng.worker.executor.decode_attn.name) == (
        backend,
        decode,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng.generate(prompts(3), sp)  # warm-up: lazy inits, autotuning
    torch.cuda.synchronize()
    for i, p in enumerate(prompts(6, seed=1)):
        eng.add(str(i), p, sp)
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.has_work():
            eng.step()  # prefill, mixed and decode steps; results read via events only
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.scheduler.cfg.max_inflight == 2
    if not eager:
        assert eng.worker.executor.graphs is not None and eng.worker.executor.graphs.num_runs > 0
    eng.check_integrity()


def test_overlap_gives_the_same_tokens_with_graphs(tiny_gpu_dir, gpu_engine):
    stop = gpu_engine(tiny_gpu_dir, "triton", "float32", cuda_graph_max_bs=16).generate(
        prompts(1), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0][3]
    cases = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
        SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=15),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
    ]

    def run(overlap):
        eng = gpu_engine(
            tiny_gpu_dir,
            "triton",
            "float32",
            cuda_graph_max_bs=16,
            disable_overlap_schedule=not overlap,
        )
        for i, (p, sp) in enumerate(zip(prompts(4), cases)):
            eng.add(str(i), p, sp)
        got = {str(i): [] for i in range(4)}
        while eng.has_work():
            for out in eng.step():
                got[out.rid].extend(out.token_ids)
        eng.check_integrity()
        assert eng.worker.executor.graphs.num_runs > 0 and not eng.worker.pending
        return got

    assert run(True) == run(False)
