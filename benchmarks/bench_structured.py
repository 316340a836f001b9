#!/usr/bin/env python3
"""What structured output (a json_schema) costs decode: the in-process engine
(scheduler + worker, as the server runs them) at a fixed batch, every row decoding,
wall time per steady-state step with every row under the schema against the same
rows free. Runs alternate (free, schema, free, schema, ...) on one engine and the
medians are compared (the goal: <= 5% of decode throughput at batch 64).

The schema keeps a row inside the grammar for the whole run (an array of at least
MIN_ITEMS strings), so every step fills a real mask per row; the report counts the
rows whose grammar had completed by the end of a run (those fill a stop-only mask).
Real text needs a real model: the embedded SmolLM2 (its GGUF) or any HF directory. A
model with dummy weights (--load-format dummy, with a real --tokenizer such as
SmolLM2's) writes random tokens inside the grammar: the masks' costly case.

    python benchmarks/bench_structured.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --device cuda --device-kind nvidia-h100-x1 --output-json structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import gyrfalcon  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.grammar.spec import json_schema_output
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.loader.resolve import resolve_model
from gyrfalcon.profiling import host_profile

MIN_ITEMS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}, "minItems": MIN_ITEMS},
    },
    "required": ["topic", "facts"],
    "additionalProperties": False,
}
TOPICS = ["rivers", "volcanoes", "bread", "chess", "owls", "glass", "tides", "copper"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"List facts about {TOPICS[i % len(TOPICS)]} (set {i}) as JSON."
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(ids if isinstance(ids, list) else ids["input_ids"])
    return out


def step_seconds(eng: LocalEngine, ps: list[list[int]], sp: SamplingParams, steps: int):
    """(seconds per steady-state step, rows whose grammar completed, each row's output):
    every row of `ps` decoding, `steps` steps timed after 8 untimed ones."""
    rids = [f"r{i}" for i in range(len(ps))]
    for rid, p in zip(rids, ps):
        eng.add(rid, p, sp)
    while any(r.num_computed < len(r.prompt_ids) for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    for _ in range(8):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    elapsed = time.perf_counter() - t0
    done, outputs = 0, []
    for rid in rids:
        sampling = eng.worker.requests[rid].sampling
        outputs.append(list(sampling.output_ids))
        done += sampling.grammar is not None and sampling.grammar.matcher.is_terminated()
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    return elapsed / steps, done, outputs


def fill_costs(eng: LocalEngine, outputs: list[list[int]]) -> dict[str, float]:
    """The grammar masks alone, replayed over the rows' outputs with fresh matchers:
    microseconds per row and step filled one row at a time and all rows at once."""
    from gyrfalcon.worker.grammar_state import allocate_bitmask, fill_masks

    so = json_schema_output(SCHEMA)
    states = [eng.worker.requests.grammars.state(so) for _ in outputs]
    bitmask = allocate_bitmask(len(states), eng.model_cfg.vocab_size)
    one = together = 0.0
    steps = min(len(o) for o in outputs)
    for t in range(steps):
        t0 = time.perf_counter()
        for row, state in enumerate(states):
            state.fill(bitmask, row, [])
        t1 = time.perf_counter()
        fill_masks(bitmask, [(row, state, []) for row, state in enumerate(states)])
        together += time.perf_counter() - t1
        one += t1 - t0
        for state, out in zip(states, outputs):
            state.sync(out[: t + 1])
    n = steps * len(states)
    return {"one_by_one_us": round(one / n * 1e6, 2), "together_us": round(together / n * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    ap.add_argument(
        "--tokenizer", default=None, help="GGUF file or HF directory (default: the model's)"
    )
    ap.add_argument(
        "--load-format", default="auto", help="dummy: random weights (--tokenizer then)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="free/schema pairs")
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--profile-dir", default=None, help="cProfile the last round's runs here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model, None)
    tokenizer_dir = resolve_model(args.tokenizer, None) if args.tokenizer else model_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    server_args = ServerArgs(
        model=model_dir,
        tokenizer=tokenizer_dir,
        load_format=args.load_format,  # type: ignore[arg-type]
        device=args.device,
        dtype=args.dtype,  # type: ignore[arg-type]
        attention_backend=args.attention_backend,  # type: ignore[arg-type]
        max_num_seqs=max(args.batch_size, 8),
    )
    eng = LocalEngine(server_args, model_dir, check_invariants=False)
    ps = prompts(tokenizer, args.batch_size)
    budget = args.steps + 64
    free = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
    schema = SamplingParams(
        temperature=0.0, max_tokens=budget, ignore_eos=True, structured=json_schema_output(SCHEMA)
    )
    eng.generate(
        ps[:2], SamplingParams(temperature=0.0, max_tokens=8, structured=schema.structured)
    )
    runs: dict[str, list[float]] = {"free": [], "schema": []}
    completed = []
    for r in range(args.rounds):
        for name, sp in (("free", free), ("schema", schema)):
            path = None
            if args.profile_dir and r == args.rounds - 1:
                Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                path = str(Path(args.profile_dir) / f"{name}.txt")
            with host_profile(path, f"bench_structured {name}, batch {args.batch_size}"):
                sec, done, outputs = step_seconds(eng, ps, sp, args.steps)
            runs[name].append(sec)
            if name == "schema":
                completed.append(done)
            print(
                f"{name:6s} {sec * 1e3:7.3f} ms/step  {args.batch_size / sec:9.0f} tok/s",
                flush=True,
            )
    fills = fill_costs(eng, outputs)  # NOTE: the last run's: a schema run
    print(f"masks alone: {fills} per row and step; a row wrote:")
    print(repr(tokenizer.decode(outputs[0]))[:400])
    med = {k: statistics.median(v) for k, v in runs.items()}
    cost = med["schema"] / med["free"] - 1.0
    report = {
        "bench": "structured_output",
        "device_kind": args.device_kind,
        "commit": git_commit(),
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "steps_per_run": args.steps,
        "ms_per_step": {k: [round(s * 1e3, 3) for s in v] for k, v in runs.items()},
        "median_tok_s": {k: round(args.batch_size / v, 1) for k, v in med.items()},
        "throughput_cost": round(cost, 4),
        "rows_grammar_completed": completed,
        "mask_fill_us_per_row": fills,
        "schema": SCHEMA,
    }
    print(f"json_schema costs {cost * 100:.1f}% of decode throughput at batch {args.batch_size}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
