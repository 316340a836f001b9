"""What each rank of test/gpu/test_all_reduce_gpu.py runs (spawned ranks import it by
name, so it lives beside the other test helpers, not in the test module): the one-shot
sum alone and fused with the add + RMSNorm, eagerly and in graphs, and DP attention's
row gathers and reduce-scatters through its rows kernels."""

import os
from datetime import timedelta

import torch


def addend(rank: int, n: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(n, generator=g).to(dtype).to(device)


def rank_order_sum(world: int, n: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    acc = torch.zeros(n, dtype=torch.float32, device=device)
    for r in range(world):
        acc += addend(r, n, dtype, seed, device).float()
    return acc.to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """got equals want bit for bit; else how many elements differ and by how much."""
    if torch.equal(got, want):
        return
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got.double() - want.double()).abs()
    bad = int((got != want).sum())
    raise AssertionError(f"{what}: {bad} of {got.numel()} differ, most by {diff.max().item():.3g}")


def assert_any_order_sum(
    got: torch.Tensor, world: int, n: int, dtype: torch.dtype, seed: int, device, part=None
) -> None:
    """got is the sum over `world` ranks' addends in some order of NCCL's own, each step
    rounded to dtype: within the bound any order of summation keeps, (world - 1) u
    sum |x_r| and the final rounding's u |sum| (u the unit roundoff of dtype)."""
    u = torch.finfo(dtype).eps / 2
    abs_sum = torch.zeros(n, dtype=torch.float32, device=device)
    exact = torch.zeros(n, dtype=torch.float64, device=device)
    for r in range(world):
        x = addend(r, n, dtype, seed, device)
        abs_sum += x.float().abs()
        exact += x.double()
    if part is not None:
        abs_sum, exact = abs_sum[part], exact[part]
    err = (got.reshape(-1).double() - exact).abs()
    bound = (world - 1) * u * abs_sum.double() + u * exact.abs() * 1.01
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{dtype} n={n}: error {err[worst].item():.3g} over the bound {bound[worst].item():.3g}"
        f" at {worst} (exact {exact[worst].item():.4g})"
    )


def say(rank: int, what: str) -> None:
    """A rank's progress on stdout (pytest -s shows where a rank stopped)."""
    print(f"rank {rank}: {what}", flush=True)


def rank_checks_one_shot(rank: int, world: int, init_addr: str, out_dir: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    from gyrfalcon.forward.distributed import init_tensor_parallel
    from gyrfalcon.kernels.norm import fused_add_rmsnorm, rmsnorm

    device = torch.device("cuda", rank)
    parallel = init_tensor_parallel(
        rank, world, world, init_addr, device, timedelta(seconds=60), custom_all_reduce=True
    )
    from gyrfalcon.forward.distributed import FUSED_MAX_ROWS, ONE_SHOT_MAX_BYTES

    comm = parallel.comm
    assert comm.one_shot is not None, "symmetric memory is available on these GPUs"
    largest = comm.one_shot.half_elems
    seed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 4095, 4096, 16 * 4096 + 3, largest, largest + 1):
            seed += 1
            say(rank, f"sum of {n} {dtype}")
            want = rank_order_sum(world, n, dtype, seed, device)
            # the kernel itself, up to the largest it takes
            x = addend(rank, n, dtype, seed, device)
            assert comm.one_shot.fits(x) == (n <= largest)
            if n <= largest:
                assert_same(comm.one_shot(x), want, ("kernel", dtype, n))
            # through the communicator: the kernel up to ONE_SHOT_MAX_BYTES, NCCL above
            x = addend(rank, n, dtype, seed, device)
            got = parallel.all_reduce(x)
            if n * dtype.itemsize <= ONE_SHOT_MAX_BYTES:
                assert_same(got, want, ("communicator", dtype, n))
            else:  # NOTE: NCCL's order of summation is its own
                assert_any_order_sum(got, world, n, dtype, seed, device)
    # the sum fused with the add + RMSNorm after it: what the sum, then the norm kernel give
    hidden = 4096
    g = torch.Generator().manual_seed(7)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    for rows in (1, 5, 16):
        seed += 1
        say(rank, f"sum + add + norm of {rows} rows")
        x = addend(rank, rows * hidden, torch.bfloat16, seed, device).view(rows, hidden)
        res = addend(world, rows * hidden, torch.bfloat16, seed, device).view(rows, hidden)
        want = fused_add_rmsnorm(
            rank_order_sum(world, rows * hidden, torch.bfloat16, seed, device).view(rows, hidden),
            res.clone(), weight, 1e-6,
        )  # fmt: skip
        if rows > FUSED_MAX_ROWS:  # NOTE: the communicator leaves those to NCCL + the norm
            assert parallel.reduce_add_rmsnorm(x.clone(), res.clone(), weight, 1e-6) is None
        got = comm.one_shot.add_rmsnorm(x, res, weight, 1e-6)
        assert got is not None and got[0] is x and got[1] is res, rows
        assert torch.equal(res, want[1]) and torch.equal(x, want[0]), rows
    big = torch.zeros(17, hidden, dtype=torch.bfloat16, device=device)
    assert comm.one_shot.add_rmsnorm(big, big.clone(), weight, 1e-6) is None  # > MAX_ROWS
    # in a graph: 24 sums a replay, each between PDL-launched norms, as in a decode step,
    # and after each a fused sum + add + norm of another addend
    calls = 24
    static_in = torch.zeros(calls, 2, hidden, dtype=torch.bfloat16, device=device)
    static_out = torch.zeros_like(static_in)
    static_res = torch.zeros_like(static_in)  # each call's residual before it
    res_out = torch.zeros_like(static_in)
    norm_out = torch.zeros_like(static_in)
    ones = torch.ones(hidden, dtype=torch.bfloat16, device=device)

    def step():
        for i in range(calls):
            h = rmsnorm(static_in[i], ones, 1e-6)
            g = h * 0.5  # NOTE: before the all-reduce, which sums in place
            static_out[i] = parallel.all_reduce(h)
            res_out[i] = static_res[i]
            normed, _ = parallel.reduce_add_rmsnorm(g, res_out[i], weight, 1e-6)
            norm_out[i] = normed

    say(rank, "graphs")
    for _ in range(2):  # warm-up: Triton builds, eagerly
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(30):
        seed += 1
        shape = static_in.shape
        static_in.copy_(addend(rank, calls * 2 * hidden, torch.bfloat16, seed, device).view(shape))
        static_res.copy_(
            addend(world, calls * 2 * hidden, torch.bfloat16, seed, device).view(shape)
        )
        graph.replay()
        torch.cuda.synchronize(device)
        # every rank's normed input, summed in rank order
        acc = torch.zeros(shape, dtype=torch.float32, device=device)
        half = torch.zeros(shape, dtype=torch.float32, device=device)
        for r in range(world):
            x_r = addend(r, calls * 2 * hidden, torch.bfloat16, seed, device).view(shape)
            normed_r = torch.stack([rmsnorm(x_r[i], ones, 1e-6) for i in range(calls)])
            acc += normed_r.float()
            half += (normed_r * 0.5).float()
        assert torch.equal(static_out, acc.to(torch.bfloat16)), f"replay {replay}"
        for i in range(calls):
            want = fused_add_rmsnorm(
                half[i].to(torch.bfloat16), static_res[i].clone(), weight, 1e-6, inplace=False
            )
            assert torch.equal(res_out[i], want[1]), (replay, i)
            assert torch.equal(norm_out[i], want[0]), (replay, i)
    check_rows_through_one_shot(rank, world, device)
    torch.save({"ok": True}, os.path.join(out_dir, f"rank{rank}.pt"))


def check_rows_through_one_shot(rank: int, world: int, device) -> None:
    """DP attention's equal-rows gather and its reduce-scatter (the MoE layers' under
    graphs) over the world, whose one-shot has its rows kernels: through them up to a
    buffer half per rank, exact (a gather is each rank's rows, a reduce-scatter this
    rank's block of the rank-order sum); NCCL above. bfloat16 and float32 calls in turn
    through one set of buffers."""
    import torch.distributed as dist

    from gyrfalcon.forward.distributed import GroupCommunicator
    from gyrfalcon.forward.one_shot import one_shot_for

    whole = dist.group.WORLD
    comm = GroupCommunicator(whole, world, one_shot_for(whole, device, True, rows=True))
    hidden, seed = 2048, 1000
    comm.equal_rows = True
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 7, 16, 64, 65):
            seed += 1
            n = rows * hidden
            say(rank, f"rows through the group: {rows} {dtype}")
            one_shot = n <= comm.one_shot.half_elems
            got, counts = comm.all_gather_rows(
                addend(rank, n, dtype, seed, device).view(rows, hidden)
            )
            want = torch.cat([addend(r, n, dtype, seed, device) for r in range(world)])
            assert counts == [rows] * world, (counts, rows)
            assert_same(got, want.view(-1, hidden), ("gather", dtype, rows, one_shot))
            x = addend(rank, world * n, dtype, seed, device).view(world * rows, hidden)
            got = comm.reduce_scatter(x)
            whole_sum = rank_order_sum(world, world * n, dtype, seed, device).view(-1, hidden)
            want = whole_sum[rank * rows : (rank + 1) * rows]
            if one_shot:
                assert_same(got, want, ("reduce-scatter", dtype, rows))
            else:  # NOTE: NCCL's order of summation is its own
                mine = slice(rank * n, (rank + 1) * n)
                assert_any_order_sum(got, world, world * n, dtype, seed, device, mine)
