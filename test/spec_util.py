"""Engines with and without EAGLE3 on a tiny random Llama target (4 layers) and a
tiny random drafter, and a forcing drafter: it proposes what plain greedy decoding
would emit, made wrong where a pattern says, so tests choose the acceptance."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from conftest import make_tiny_eagle3, make_tiny_hf_model

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import ForwardMode, RequestOutput, SamplingParams
from gyrfalcon.worker.draft_round import DraftRound
from gyrfalcon.worker.drafter import Drafter
from gyrfalcon.worker.spec_step_graph import VARIANT

VOCAB = 256


def make_pair(root, hidden: int = 64, heads: int = 4) -> tuple[str, str]:
    """hidden 256: head_dim 64, flashinfer's smallest (with 4 heads); `heads`: attention
    heads of both (tp sizes up to it split them)."""
    target, draft = str(root / "target"), str(root / "draft")
    inter = 2 * hidden
    make_tiny_hf_model(
        target, "llama", num_hidden_layers=4, hidden_size=hidden, intermediate_size=inter,
        num_attention_heads=heads,
    )  # fmt: skip
    make_tiny_eagle3(
        draft, hidden_size=hidden, target_hidden_size=hidden, intermediate_size=inter,
        num_attention_heads=heads,
    )  # fmt: skip
    return target, draft


def make_drafter_for(model: str, path: str) -> str:
    """A tiny random EAGLE3 drafter at `path` for the tiny target in `model` (its RoPE
    theta; 512 positions); returns path."""
    import json

    with open(f"{model}/config.json") as f:
        cfg = json.load(f)
    make_tiny_eagle3(path, rope_theta=cfg.get("rope_theta", 10000.0), max_position_embeddings=512)
    return path


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lens]


def engine(target: str, draft: str | None = None, k: int = 3, **kw) -> LocalEngine:
    base = dict(device="cpu", dtype="float32", page_size=4, num_kv_pages=128)
    base.update(kw)
    if draft is not None:
        base.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft,
            speculative_num_steps=k,
        )
    return LocalEngine(ServerArgs(model=target, **base), target)


def run(eng: LocalEngine, ps: list[list[int]], sp: SamplingParams | list[SamplingParams]):
    """Outputs (rid -> the RequestOutputs' concatenated ids, logprobs, finish reason)."""
    sps = sp if isinstance(sp, list) else [sp] * len(ps)
    for i, (p, s) in enumerate(zip(ps, sps)):
        eng.add(str(i), p, s)
    ids: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    lps: dict[str, list] = {str(i): [] for i in range(len(ps))}
    last = {}
    while eng.has_work():
        for out in eng.step():
            ids[out.rid].extend(out.token_ids)
            lps[out.rid].extend(out.logprobs or [])
            last[out.rid] = out
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages, "leaked pages"
    rids = [str(i) for i in range(len(ps))]
    return Outputs([ids[r] for r in rids], [lps[r] for r in rids], [last[r] for r in rids])


@dataclass
class Outputs:
    ids: list[list[int]]  # per request, every output token
    logprobs: list[list]  # per request, every PositionLogprobs
    final: list[RequestOutput]  # per request, its last output (finish reason, counters)

    @property
    def verify_steps(self) -> int:
        return sum(o.num_verify_steps for o in self.final)

    @property
    def accepted(self) -> int:
        return sum(o.num_accepted for o in self.final)


Pattern = Callable[[str, int], int]  # (rid, anchor position) -> drafts to make right


def force_drafts(eng: LocalEngine, sequences: dict[str, list[int]], pattern: Pattern, k: int):
    """Make the engine's drafter propose sequences[rid][p + 2 + j] for draft j + 1 after
    anchor p (what greedy decoding emits there), the first pattern(rid, p) of them
    right and the rest off by one id. Returns the list of (rid, anchor, right) made."""
    drafter = eng.worker.drafter
    assert isinstance(drafter, Drafter)
    table = eng.worker.requests
    made: list[tuple[str, int, int]] = []
    real = drafter.draft

    def force(slots: list[int], anchors: list[int]) -> None:
        slot_rid = {table[rid].slot: rid for rid in table._requests}
        for slot, p in zip(slots, anchors):
            if slot == table.scratch:
                continue  # a padded row of the fused step
            rid = slot_rid[slot]
            seq, right = sequences[rid], pattern(rid, p)
            drafts = []
            for j in range(k):
                tok = seq[p + 2 + j] if p + 2 + j < len(seq) else 3
                drafts.append(tok if j < right else (tok + 1) % VOCAB)
            table.draft_tokens[slot] = torch.tensor(drafts)
            made.append((rid, p, right))

    def draft(rnd: DraftRound, ids, aux, accept_len, draft_tokens) -> None:
        real(rnd, ids, aux, accept_len, draft_tokens)  # NOTE: KV and graphs as usual
        anchors = rnd.ext.positions[rnd.anchor_idx] + accept_len[rnd.accept_row]
        force(rnd.slots.tolist(), anchors.tolist())

    drafter.draft = draft
    fused, graphs = eng.worker.fused, eng.worker.executor.graphs
    if fused is not None and graphs is not None and graphs.mode == "cuda":
        eng.worker.fused = None  # NOTE: a captured step cannot be forced: the general path
    elif fused is not None:  # NOTE: the fused step's round too, after it ran (static replay)
        assert graphs is not None
        name, k1 = (ForwardMode.VERIFY, VARIANT), k + 1
        spec = graphs.specs[name]

        def step(batch):
            emitted, accepted = spec.forward(batch)
            slots = fused.rows[0, : batch.batch_size].tolist()
            force(slots, (batch.positions[::k1] + accepted[::k1]).tolist())
            return emitted, accepted

        graphs.specs[name] = dataclasses.replace(spec, forward=step)
    return made


def random_pattern(seed: int, k: int) -> Pattern:
    rng = random.Random(seed)
    return lambda rid, p: rng.randint(0, k)


def check_round_replay(eng: LocalEngine, exact: bool = True) -> list[tuple[int, float]]:
    """Make every draft round that runs through the drafter's graph runner (or its
    extend through the drafter's piecewise graphs) run eagerly too, from the same state
    (rewriting the same KV), and compare the drafts. Returns (rows, fraction of drafts
    equal) per compared round; `exact` asserts all equal."""
    drafter = eng.worker.drafter
    assert isinstance(drafter, Drafter) and drafter.graphs is not None
    real, compared = drafter.draft, []

    def runs() -> tuple[int, int]:
        pw = drafter.piecewise
        return drafter.graphs.num_runs, 0 if pw is None else pw.num_runs

    def both(rnd: DraftRound, ids, aux, accept_len, draft_tokens) -> None:
        before = runs()
        real(rnd, ids, aux, accept_len, draft_tokens)
        if runs() == before:
            return  # no graph ran: eager already
        replayed = draft_tokens[rnd.slots].clone()
        graphs, pw = drafter.graphs, drafter.piecewise
        drafter.graphs = drafter.piecewise = None
        try:
            real(rnd, ids, aux, accept_len, draft_tokens)
        finally:
            drafter.graphs, drafter.piecewise = graphs, pw
        same = (draft_tokens[rnd.slots] == replayed).float().mean().item()
        assert not exact or same == 1.0, "replayed drafts differ from eager ones"
        compared.append((len(rnd.slots), same))

    drafter.draft = both
    return compared


def record_accepts(eng: LocalEngine) -> list[list[tuple[str, int]]]:
    """Each step result's (rid, accepted drafts) per row, appended as results come in."""
    steps: list[list[tuple[str, int]]] = []
    process = eng.scheduler.process_result

    def recorded(result):
        steps.append([(row.rid, row.num_accepted) for row in result.rows])
        return process(result)

    eng.scheduler.process_result = recorded
    return steps


def record_drafts(eng: LocalEngine) -> list[list[list[int]]]:
    """Every round of `Drafter.draft`: its drafts (k ids per proposing row), in order.
    (Rounds inside the fused step's graph do not pass there: turn it off to see all.)"""
    drafter, rounds = eng.worker.drafter, []
    assert isinstance(drafter, Drafter)
    real = drafter.draft

    def recorded(rnd: DraftRound, ids, aux, accept_len, draft_tokens) -> None:
        real(rnd, ids, aux, accept_len, draft_tokens)
        rounds.append(draft_tokens[rnd.slots].tolist())

    drafter.draft = recorded
    return rounds


def record_graph_runs(eng: LocalEngine, drafter: bool = False) -> list[tuple]:
    """(mode name, *variant, rows) of every run through the target's graph runner (the
    drafter's with `drafter`)."""
    owner = eng.worker.drafter if drafter else eng.worker.executor
    graphs, runs = owner.graphs, []
    assert graphs is not None
    replay = graphs.run

    def recorded(mode, bt, *variant, **padding):
        runs.append((mode.name, *variant, len(bt.seq_lens_cpu)))
        return replay(mode, bt, *variant, **padding)

    graphs.run = recorded
    return runs
