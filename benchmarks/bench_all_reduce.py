"""What one TP all-reduce costs inside a CUDA graph: NCCL against the one-shot Triton
kernel over symmetric memory (`forward/one_shot.py`), on every GPU of this machine.

Each graph holds CALLS repetitions of a PDL-launched RMSNorm over [rows, hidden] bf16
followed by the all-reduce of its output, as a TP decode step interleaves its kernels
and sums; a graph of the norms alone is the baseline subtracted. Up to the fused
kernel's rows, also the sum followed by the residual add + RMSNorm (NCCL or one-shot,
then the norm kernel) against the one launch that does both. With --dp-rows, also
DP attention's pair of a MoE layer over the world: the gather of every rank's M rows
of --dp-hidden and the reduce-scatter back, through NCCL against the one-shot's rows
kernels (`kernels/rows_exchange.py`). Rank 0 prints tables and writes JSON:

    python benchmarks/bench_all_reduce.py --device-kind nvidia-h100-x2 --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

CALLS = 64


def time_graph(step, device, replays: int) -> float:
    """Mean microseconds of one replay of a graph of `step`."""
    for _ in range(2):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1000 / replays


def rank_main(rank: int, world: int, port: int, ns: argparse.Namespace) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    from gyrfalcon.forward.distributed import GroupCommunicator, init_tensor_parallel
    from gyrfalcon.kernels.all_reduce import MAX_ROWS
    from gyrfalcon.kernels.norm import fused_add_rmsnorm, rmsnorm

    device = torch.device("cuda", rank)
    parallel = init_tensor_parallel(
        rank, world, world, f"tcp://127.0.0.1:{port}", device, timedelta(seconds=60),
        custom_all_reduce=True,
    )  # fmt: skip
    one_shot = parallel.comm.one_shot  # the kernel itself, whatever the size
    nccl = GroupCommunicator(parallel.comm.group, world)  # the same group, NCCL only
    rows_out = []
    for rows in ns.rows:
        x = torch.randn(rows, ns.hidden, dtype=torch.bfloat16, device=device)
        w = torch.ones(ns.hidden, dtype=torch.bfloat16, device=device)

        def step(reduce=None, x=x, w=w):
            for _ in range(CALLS):
                h = rmsnorm(x, w, 1e-6)
                if reduce is not None:
                    reduce(h)

        norms = time_graph(step, device, ns.replays)
        row = {"rows": rows, "bytes": rows * ns.hidden * 2, "norm_us": norms / CALLS}
        for name, reduce in (("nccl", nccl.all_reduce), ("one_shot", one_shot)):
            if name == "one_shot" and not one_shot.fits(x):
                continue
            total = time_graph(lambda f=reduce: step(f), device, ns.replays)
            row[f"{name}_us"] = (total - norms) / CALLS
        if rows <= MAX_ROWS:  # the sum with the add + norm after it: separate, then fused
            res = torch.zeros_like(x)

            def then_norm(sum_, res=res, w=w):
                return lambda h: fused_add_rmsnorm(sum_(h), res, w, 1e-6)

            for name, reduce in (
                ("nccl_then_norm", then_norm(nccl.all_reduce)),
                ("one_shot_then_norm", then_norm(one_shot)),
                ("fused", lambda h, res=res, w=w: one_shot.add_rmsnorm(h, res, w, 1e-6)),
            ):
                total = time_graph(lambda f=reduce: step(f), device, ns.replays)
                row[f"{name}_us"] = (total - norms) / CALLS
        rows_out.append(row)
    dp_rows = [time_dp_rows(m, world, device, ns) for m in ns.dp_rows]
    if rank == 0:
        cols = ("nccl", "one_shot", "nccl_then_norm", "one_shot_then_norm", "fused")
        print(f"{'rows':>5} {'KiB':>6} {'norm us':>8} " + " ".join(f"{c:>18}" for c in cols))
        for r in rows_out:
            kib = r["bytes"] / 1024
            got = [f"{r[c + '_us']:18.2f}" if c + "_us" in r else f"{'-':>18}" for c in cols]
            print(f"{r['rows']:5d} {kib:6.0f} {r['norm_us']:8.2f} " + " ".join(got))
        if dp_rows:
            print(f"\n{'rows a rank':>11} {'gather+scatter us: nccl':>24} {'one_shot':>9}")
        for r in dp_rows:
            print(f"{r['rows']:11d} {r['nccl_us']:24.2f} {r.get('one_shot_us', float('nan')):9.2f}")
        if ns.output_json:
            from gyrfalcon.bench.provenance import git_commit

            out = {
                "bench": "all_reduce", "device_kind": ns.device_kind, "commit": git_commit(),
                "world": world, "hidden": ns.hidden, "calls_per_graph": CALLS, "rows": rows_out,
                "dp_hidden": ns.dp_hidden, "dp_rows": dp_rows,
            }  # fmt: skip
            with open(ns.output_json, "w") as f:
                json.dump(out, f, indent=1)


def time_dp_rows(m: int, world: int, device, ns: argparse.Namespace) -> dict:
    """Microseconds of one MoE layer's gather of every rank's m rows and reduce-scatter
    back (equal rows, as graphs run them), after a PDL-launched norm: NCCL against the
    one-shot's rows kernels where they take m rows."""
    import torch.distributed as dist

    from gyrfalcon.forward.distributed import GroupCommunicator
    from gyrfalcon.forward.one_shot import one_shot_for
    from gyrfalcon.kernels.norm import rmsnorm

    whole = dist.group.WORLD
    comms = {
        "nccl": GroupCommunicator(whole, world),
        "one_shot": GroupCommunicator(whole, world, one_shot_for(whole, device, True, rows=True)),
    }
    x = torch.randn(m, ns.dp_hidden, dtype=torch.bfloat16, device=device)
    w = torch.ones(ns.dp_hidden, dtype=torch.bfloat16, device=device)

    def step(comm=None):
        for _ in range(CALLS):
            h = rmsnorm(x, w, 1e-6)
            if comm is not None:
                comm.reduce_scatter(comm.all_gather_rows(h)[0])

    norms = time_graph(step, device, ns.replays)
    row = {"rows": m, "bytes_a_rank": m * ns.dp_hidden * 2}
    for name, comm in comms.items():
        comm.equal_rows = True
        if name == "one_shot" and not comm.one_shot.rows_fit(x):
            continue
        row[f"{name}_us"] = (time_graph(lambda c=comm: step(c), device, ns.replays) - norms) / CALLS
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--dp-rows", type=int, nargs="*", default=[], help="rows a rank, e.g. 4 16 64")
    ap.add_argument("--dp-hidden", type=int, default=2048)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    from gyrfalcon.utils import free_port

    world = torch.cuda.device_count()
    mp.spawn(rank_main, args=(world, free_port(), ns), nprocs=world, join=True)


if __name__ == "__main__":
    main()
