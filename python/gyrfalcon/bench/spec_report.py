"""The figures and report of benchmarks/bench_spec.py (EAGLE3 against plain decoding):
one chat completion's outputs, acceptance from the usage fields, throughput, output
comparison, the JSON report (which names the commit and the date) and its markdown table.
Tested without servers."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyrfalcon.bench.metrics import mean
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.loader.resolve import default_model_name

SHOWN_MISMATCHES = 3  # mismatching outputs quoted in the report
SNIPPET_CHARS = 80  # characters quoted around an output's first difference


@dataclass
class ChatOutput:
    """What one greedy chat completion returned (error set when it failed)."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    spec_accept_length: float | None = None  # usage: mean tokens emitted per verify step
    spec_verify_steps: int | None = None  # usage: verify steps of this request
    latency_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


Runs = dict[int, tuple[list[ChatOutput], float]]  # concurrency -> (outputs, wall time)
# per server, per concurrency: each round's (completion tokens, wall seconds)
RoundFigures = dict[str, dict[int, list[tuple[int, float]]]]


def parse_chat_response(body: dict[str, Any]) -> ChatOutput:
    """A non-streamed chat completion body -> ChatOutput (spec fields None when absent)."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    accept, steps = usage.get("spec_accept_length"), usage.get("spec_verify_steps")
    return ChatOutput(
        text=(choice.get("message") or {}).get("content") or "",
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=choice.get("finish_reason"),
        spec_accept_length=None if accept is None else float(accept),
        spec_verify_steps=None if steps is None else int(steps),
    )


def acceptance(outputs: Sequence[ChatOutput]) -> dict[str, Any]:
    """Acceptance lengths over the successful requests with at least one verify step
    (one with none, e.g. done at its prefill, reports 1.0 and is left out).

    token_weighted = sum(completion tokens) / sum(verify steps) (the first token,
    from the prefill, counted in); per_verify_step = sum(len_i * steps_i) /
    sum(steps_i), the server's own figure over all requests (first token left out);
    mean_per_request = mean of usage.spec_accept_length.
    """
    reported = [o for o in outputs if o.ok and o.spec_verify_steps is not None]
    rows = [o for o in reported if o.spec_verify_steps]
    steps = sum(o.spec_verify_steps or 0 for o in rows)
    tokens = sum(o.completion_tokens for o in rows)
    lengths = [o for o in rows if o.spec_accept_length is not None]
    emitted = sum((o.spec_accept_length or 0.0) * (o.spec_verify_steps or 0) for o in lengths)
    length_steps = sum(o.spec_verify_steps or 0 for o in lengths)
    return {
        "requests_with_spec_usage": len(reported),
        "requests_verified": len(rows),
        "total_verify_steps": steps,
        "accept_length_token_weighted": tokens / steps if steps else None,
        "accept_length_per_verify_step": emitted / length_steps if length_steps else None,
        "accept_length_mean_per_request": mean([o.spec_accept_length for o in lengths]),
    }


def throughput(outputs: Sequence[ChatOutput], duration: float) -> dict[str, Any]:
    """Completion tokens of the successful requests per second of wall time."""
    tokens = sum(o.completion_tokens for o in outputs if o.ok)
    return {
        "completed": sum(o.ok for o in outputs),
        "failed": sum(not o.ok for o in outputs),
        "output_tokens": tokens,
        "duration_s": duration,
        "output_throughput": tokens / duration if duration > 0 else 0.0,
    }


def first_difference(a: str, b: str) -> int:
    """Index of the first character where a and b differ (len of the shorter if a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_outputs(
    a: Sequence[ChatOutput], b: Sequence[ChatOutput], shown: int = SHOWN_MISMATCHES
) -> dict[str, Any]:
    """Pairs (same prompt) whose greedy outputs differ: text, token count or finish
    reason. Pairs with a failed side are counted apart, not compared."""
    assert len(a) == len(b), "outputs of the same prompts"
    failed, mismatched, examples = 0, 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if not (x.ok and y.ok):
            failed += 1
            continue
        same = (x.text, x.completion_tokens, x.finish_reason)
        if same == (y.text, y.completion_tokens, y.finish_reason):
            continue
        mismatched += 1
        if len(examples) < shown:
            at = first_difference(x.text, y.text)
            lo, hi = max(0, at - SNIPPET_CHARS // 2), at + SNIPPET_CHARS // 2
            examples.append({
                "prompt_index": i, "first_difference_char": at,
                "tokens": [x.completion_tokens, y.completion_tokens],
                "finish_reasons": [x.finish_reason, y.finish_reason],
                "snippets": [x.text[lo:hi], y.text[lo:hi]],
            })  # fmt: skip
    return {"compared": len(a) - failed, "failed_pairs": failed, "mismatches": mismatched,
            "examples": examples}  # fmt: skip


def _spec_usage(o: ChatOutput) -> tuple[int, float | None, int | None]:
    return o.completion_tokens, o.spec_accept_length, o.spec_verify_steps


def rounds_against_first(outputs: Sequence[ChatOutput], rounds: int) -> list[dict[str, Any]]:
    """Each later round (bench_spec.py --rounds: the same requests again, their prompts
    now in the prefix cache) against round 1, request by request: how many texts
    changed (bf16 numerics on a cache hit), and how many kept their text but not their
    acceptance (tokens, accept length or verify steps). Over stop 40's served rounds the second
    count was 0 of 20 in every tree: the drafter drafts alike on a hit where the text
    is alike, so the rounds' acceptance moved with the texts alone."""
    n = len(outputs) // rounds
    first = outputs[:n]
    out = []
    for r in range(1, rounds):
        pairs = [(a, b) for a, b in zip(first, outputs[r * n : (r + 1) * n]) if a.ok and b.ok]
        same = [(a, b) for a, b in pairs if a.text == b.text]
        moved = sum(_spec_usage(a) != _spec_usage(b) for a, b in same)
        out.append({"compared": len(pairs), "changed_texts": len(pairs) - len(same),
                    "same_text_other_acceptance": moved})  # fmt: skip
    return out


def concurrency_row(
    concurrency: int,
    plain: tuple[list[ChatOutput], float],
    spec: tuple[list[ChatOutput], float],
    plain_reference: Sequence[ChatOutput],
) -> dict[str, Any]:
    """Every figure of one concurrency (plain_reference: plain outputs at the first)."""
    p, s = throughput(*plain), throughput(*spec)
    speedup = s["output_throughput"] / p["output_throughput"] if p["output_throughput"] else None
    return {
        "concurrency": concurrency,
        "requests": len(plain[0]),
        "plain": p,
        "spec": s,
        "speedup": speedup,
        "acceptance": acceptance(spec[0]),
        "plain_vs_spec": compare_outputs(plain[0], spec[0]),
        "plain_vs_first_concurrency": compare_outputs(plain_reference, plain[0])["mismatches"],
    }


def request_columns(outputs: list[ChatOutput]) -> dict[str, list[Any]]:
    """The requests' figures for the JSON as parallel columns, one per ChatOutput field
    but the text (texts are compared, not kept)."""
    names = [f.name for f in dataclasses.fields(ChatOutput) if f.name != "text"]
    return {n: [getattr(o, n) for o in outputs] for n in names}


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _per_round(row: dict[str, Any]) -> str:
    """A row's accept length in each round (bench_spec.py --rounds), or '-'."""
    return " / ".join(_num(x) for x in row.get("rounds_accept_length", [])) or "-"


def _against_first(row: dict[str, Any]) -> str:
    """A row's later rounds against round 1 (`rounds_against_first`), or '-'."""
    return (
        " / ".join(
            f"{r['changed_texts']} and {r['same_text_other_acceptance']} of {r['compared']}"
            for r in row.get("rounds_against_first", [])
        )
        or "-"
    )


def _ab_lines(report: dict[str, Any]) -> list[str]:
    """With `ab_rows` (bench_spec.py --ab-trees): a table of every EAGLE3 server, this
    tree's first, against the one plain server."""
    ab = report.get("ab_rows")
    if not ab:
        return []
    lines = [
        "", "EAGLE3 servers of other source trees (`--ab-trees`), up with the two above and "
        "sent every round in turn; speed-ups against the same plain server:", "",
        "| server | concurrency | accept length (tokens / verify steps) "
        "| accept length per round | EAGLE3 tok/s "
        "| speed-up | EAGLE3 tok/s per round | mismatches with plain | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for name, rows in (("spec", report["rows"]), *ab.items()):
        label = f"spec (commit {report['commit']})" if name == "spec" else name
        for r in rows:
            per = r.get("rounds_output_throughput", {}).get(name, [])
            speedup = "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            lines.append(
                f"| {label} | {r['concurrency']} "
                f"| {_num(r['acceptance']['accept_length_token_weighted'])} "
                f"| {_per_round(r)} "
                f"| {_num(r['spec']['output_throughput'], 1)} | {speedup} "
                f"| {' / '.join(_num(x, 0) for x in per) or '-'} "
                f"| {r['plain_vs_spec']['mismatches']} of {r['plain_vs_spec']['compared']} "
                f"| {r['spec']['failed']} |"
            )
    return lines


def format_markdown(report: dict[str, Any]) -> str:
    """The results as a short markdown page: a header naming the setup, one row per
    concurrency."""
    w = report.get("min_waves", 0)
    waves = f" (cycled to at least {w} x the concurrency requests)" if w else ""
    lines = [
        f"# EAGLE3 speculative decoding vs. plain (device kind: {report['device_kind']})",
        "",
        f"Target `{report['model']}`, drafter `{report['draft_model']}`, "
        f"k = {report['num_steps']}; {report['num_prompts']} first turns of "
        f"`{report['dataset']}`{waves}, greedy chat completions, max_tokens "
        f"{report['max_tokens']}; "
        f"commit {report['commit']}; server flags: `{' '.join(report['server_args']) or '-'}`. "
        "Accept length: tokens emitted per verify step (accepted + 1). Mismatches: "
        "requests whose greedy output differs between the two servers (0 in float32; in bf16 "
        "near-ties flip with the kernels, as between batch sizes).",
        "",
        "| concurrency | requests | accept length (tokens / verify steps) "
        "| accept length (mean per request) | plain tok/s | EAGLE3 tok/s | speed-up "
        "| mismatches | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        acc, cmp = r["acceptance"], r["plain_vs_spec"]
        speedup = "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {r['concurrency']} | {r['requests']} "
            f"| {_num(acc['accept_length_token_weighted'])} "
            f"| {_num(acc['accept_length_mean_per_request'])} "
            f"| {_num(r['plain']['output_throughput'], 1)} "
            f"| {_num(r['spec']['output_throughput'], 1)} | {speedup} "
            f"| {cmp['mismatches']} of {cmp['compared']} "
            f"| {r['plain']['failed'] + r['spec']['failed']} |"
        )
    rounds = [
        f"c{r['concurrency']}: "
        + "; ".join(f"{_num(p, 0)} / {_num(s, 0)}" for p, s in zip(*per.values(), strict=True))
        for r in report["rows"]
        if (per := r.get("rounds_output_throughput"))
    ]
    if rounds:
        accept = "; ".join(f"c{r['concurrency']}: {_per_round(r)}" for r in report["rows"])
        moved = "; ".join(f"c{r['concurrency']}: {_against_first(r)}" for r in report["rows"])
        lines += ["", f"{report['rounds']} rounds, both servers up at once, each round sent to "
                  "one then the other (the order alternating); tok/s per round, plain / EAGLE3: "
                  + ". ".join(rounds) + f". EAGLE3 accept length per round: {accept} (later "
                  "rounds find the prompts in the prefix cache). EAGLE3 requests of each "
                  "later round whose text changed from round 1, and whose text did not but "
                  f"whose acceptance did: {moved}."]  # fmt: skip
    lines += _ab_lines(report)
    drift = [f"{r['plain_vs_first_concurrency']} at {r['concurrency']}" for r in report["rows"]]
    if any(r["plain_vs_first_concurrency"] for r in report["rows"]):
        lines += ["", "Plain outputs differing from plain at the first concurrency (batch "
                  f"numerics, no speculation involved): {', '.join(drift)}."]  # fmt: skip
    if pages := report.get("pages"):
        each = "; ".join(
            f"{name} {p['free']} of {p['total']} free, integrity "
            f"{'ok' if p['integrity_ok'] else 'FAILED'}"
            for name, p in pages.items()
        )
        lines += ["", f"KV pages after the runs: {each}."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the report


def cycled(items: Sequence[Any], concurrency: int, min_waves: int) -> list[Any]:
    """The items, cycled to max(len, min_waves * concurrency) of them (item i % len at
    i): `concurrency` requests stay in flight for at least `min_waves` waves."""
    n = max(len(items), min_waves * concurrency)
    return [items[i % len(items)] for i in range(n)]


def build_report(
    ns: argparse.Namespace,
    extra: Sequence[str],
    num_prompts: int,
    commands: dict[str, list[str]],
    runs: dict[str, Runs],
    figures: RoundFigures | None = None,
) -> dict[str, Any]:
    """The JSON report: setup, one row per concurrency (with `figures`: each round's
    tok/s per server), with --ab-trees `ab_rows` (each tree's EAGLE3 server: the same rows
    against the one plain server), per-request figures (no texts)."""
    first = runs["plain"][ns.concurrency[0]][0]

    def spec_rows(name: str) -> list[dict[str, Any]]:
        return [
            concurrency_row(
                c, runs["plain"][c], runs[name][c], cycled(first, len(runs["plain"][c][0]), 1)
            )
            for c in ns.concurrency
        ]

    rows = spec_rows("spec")
    trees = {name: spec_rows(name) for name in runs if name not in ("plain", "spec")}
    for name, named_rows in (("spec", rows), *trees.items()):
        for row in named_rows if figures else []:
            c = row["concurrency"]
            row["rounds_output_throughput"] = {
                key: [round(t / w, 1) if w > 0 else None for t, w in figures[key][c]]
                for key in ("plain", name)
            }
            # NOTE: rounds after the first find the prompts in the prefix cache; in bf16
            # that changes texts, and so the acceptance (stop 40: 2.49 -> 2.41, 20 of 40
            # texts changed, the other 20 accepted alike: `rounds_against_first`)
            outs, n = runs[name][c][0], len(runs[name][c][0]) // ns.rounds
            row["rounds_accept_length"] = [
                acceptance(outs[i * n : (i + 1) * n])["accept_length_token_weighted"]
                for i in range(ns.rounds)
            ]
            row["rounds_against_first"] = rounds_against_first(outs, ns.rounds)
    return {
        "bench": "spec", "device_kind": ns.device_kind, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "model": default_model_name(ns.model), "draft_model": ns.draft_model,
        "num_steps": ns.num_steps, "dataset": Path(ns.dataset).name,
        "num_prompts": num_prompts, "min_waves": ns.min_waves, "rounds": ns.rounds,
        "max_tokens": ns.max_tokens,
        "server_args": list(extra), "spec_flags": ns.spec_flags,
        "commands": commands, "rows": rows, **({"ab_rows": trees} if trees else {}),
        "per_request": {
            str(c): {name: request_columns(runs[name][c][0]) for name in runs}
            for c in ns.concurrency
        },
    }  # fmt: skip
