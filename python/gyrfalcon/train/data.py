"""Training data: prompts, the target's own greedy answers, the draft vocabulary.

EAGLE3 learns to predict what the target will say, so the text is the target's own:
each prompt through the chat template, answered greedily by our engine
(`LocalEngine`, the server's scheduler and worker in-process). A sequence is the
prompt's ids followed by the answer's; the loss covers the answer only.

On a GPU the host's Python per row and step bounds generation, not the device: `complete`
can hand shares of the prompts to copies of the engine in spawned processes on the same
device (`EngineCopies`), whose steps interleave there.

Follow-up turns (`follow_up_conversations`) widen that text: a prompt, the target's
answer, then a generic follow-up question (`FOLLOW_UPS`, written for this purpose,
none from an evaluation set), and the target's second answer, which alone is
trained on.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams

# Generic second turns: what a user asks after an answer, whatever the topic
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in two sentences.",
    "Give me another example.",
    "Rewrite your answer so that a ten-year-old can follow it.",
    "What is the most important point here, and why?",
    "Answer again, as a short list.",
    "Are there any mistakes or caveats in your answer?",
    "Write a short title for your answer.",
)


@dataclass(frozen=True)
class TrainSequence:
    ids: list[int]  # prompt ids then answer ids
    prompt_len: int  # positions [prompt_len, len(ids)) are the answer


def load_prompts(path: str, num_prompts: int, seed: int) -> list[str]:
    """The 'prompt' field of each line of a JSONL file, `num_prompts` of them drawn
    with `seed` (0: all, shuffled). ValueError names a line without a prompt."""
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line).get("prompt")
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc})") from exc
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{lineno}: no non-empty 'prompt' string field")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts] if num_prompts > 0 else prompts


def prompts_by_source(path: str, prompts: Sequence[str]) -> list[list[str]]:
    """`prompts` (drawn from the JSONL file at `path` by `load_prompts`) grouped by each
    line's 'source' field (one group for lines without one), groups in source order."""
    source: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                source.setdefault(rec["prompt"], str(rec.get("source", "")))
    groups: dict[str, list[str]] = {}
    for p in prompts:
        groups.setdefault(source[p], []).append(p)
    return [groups[k] for k in sorted(groups)]


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat_template: bool) -> list[list[int]]:
    """Each prompt as one user turn through the chat template with the generation
    prompt (the template writes BOS and special tokens, so encoding adds none), or the
    raw text encoded as the tokenizer does by default when `chat_template` is off."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: pass --no-chat-template to train on the "
            "raw prompt text, or --tokenizer with a template"
        )
    out = []
    for prompt in prompts:
        if chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(prompt))
    return out


def follow_up_conversations(
    tokenizer: Any,
    prompts: Sequence[str],
    answers: Sequence[list[int]],
    seed: int,
) -> list[list[int]]:
    """Each prompt, the target's answer (decoded, special tokens dropped) and a
    follow-up drawn with `seed` from FOLLOW_UPS, through the chat template with the
    generation prompt: the ids of a conversation awaiting its second answer."""
    rng = random.Random(seed)
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


@dataclass(frozen=True)
class Completion:
    """What the engine wrote after one prompt."""

    ids: list[int]  # the new tokens, EOS included when it stopped on one; [] on an error
    finish_reason: str  # "stop" (EOS), "length" (max_tokens or the context), "error", ...


class EngineCopies:
    """`workers - 1` copies of an engine (its args and model) in spawned processes on its
    device, started once and given a share of every `complete` call until closed (a
    context manager; with workers == 1 there are none). Copy w answers prompts w,
    w + workers, ...; the engine itself share 0."""

    def __init__(self, engine: LocalEngine, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        # NOTE: per `complete` call: (its name, share 0's seconds, the seconds it then
        # waited for the copies' shares; the first call's include the copies' start)
        self.calls: list[tuple[str, float, float]] = []
        ctx = mp.get_context("spawn")  # NOTE: a forked child would share the parent's CUDA
        for _ in range(1, workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_copy, args=(engine.args, engine.model_dir, theirs), daemon=True
            )
            proc.start()
            theirs.close()  # NOTE: the child's end only: recv raises EOFError if it dies
            self.procs.append(proc)
            self.conns.append(mine)

    def send(self, prompts: Sequence[list[int]], sampling: Sequence[SamplingParams]) -> None:
        for w, conn in enumerate(self.conns, start=1):
            conn.send((list(prompts[w :: self.workers]), list(sampling[w :: self.workers])))

    def gather(self, out: list[Completion | None]) -> None:
        """Each copy's share of the call `send` gave them, into out."""
        for w, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            try:
                got = conn.recv()
            except EOFError:
                proc.join()
                got = f"exited with code {proc.exitcode} before answering"
            if isinstance(got, str):
                self.close()
                raise RuntimeError(f"generation worker {w} of {self.workers}: {got}")
            out[w :: self.workers] = [Completion(ids, reason) for ids, reason in got]

    def summary(self) -> str:
        """Where the generation's time went, call by call (`calls`)."""
        return "; ".join(
            f"{name}: share 0 {own:.1f} s, the copies' {waited:.1f} s later"
            for name, own, waited in self.calls
        )

    def close(self) -> None:
        for proc, conn in zip(self.procs, self.conns, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:  # NOTE: it died since
                    pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            conn.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> EngineCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_copy(args: Any, model_dir: str, conn: Any) -> None:
    """The loop of an `EngineCopies` process: an engine of its own, then (prompts,
    sampling) shares answered as (ids, finish_reason) pairs until None; an error is
    sent as a string and ends it."""
    try:
        engine = LocalEngine(args, model_dir, check_invariants=False)
        while (work := conn.recv()) is not None:
            got = _complete(engine, *work, "", progress=False)
            conn.send([(c.ids, c.finish_reason) for c in got])
    except Exception as exc:  # NOTE: the parent raises it with the worker's number
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def complete(
    engine: LocalEngine,
    prompts: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    desc: str,
    copies: EngineCopies | None = None,
) -> list[Completion]:
    """The trainer's one generation loop: prompt i continued by the engine under
    sampling[i] (greedy answers, sampled instructions), `max_num_seqs` at a time, a
    progress bar named `desc` (share 0's, with copies); copies: engines in other
    processes that take their shares at the same time."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)} prompts, {len(sampling)} sampling settings")
    if copies is None or copies.workers == 1:
        return _complete(engine, prompts, sampling, desc)
    n = copies.workers
    copies.send(prompts, sampling)
    out: list[Completion | None] = [None] * len(prompts)
    start = time.perf_counter()
    out[0::n] = _complete(engine, prompts[0::n], sampling[0::n], desc)
    own_done = time.perf_counter()
    copies.gather(out)
    copies.calls.append((desc, own_done - start, time.perf_counter() - own_done))
    assert all(c is not None for c in out)
    return out  # type: ignore[return-value]


def _complete(
    engine: LocalEngine,
    prompts: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    desc: str,
    progress: bool = True,
) -> list[Completion]:
    """`complete` on one engine."""
    for i, (p, sp) in enumerate(zip(prompts, sampling, strict=True)):
        engine.add(str(i), p, sp)
    ids: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    reasons: dict[str, str] = {}
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    tokens = 0
    while engine.has_work():
        for out in engine.step():
            ids[out.rid].extend(out.token_ids)
            tokens += len(out.token_ids)
            if out.finish_reason is not None:
                reasons[out.rid] = out.finish_reason
                if out.error is not None:
                    ids[out.rid] = []
                bar.update(1)
        bar.set_postfix(tokens=tokens, refresh=False)
    bar.close()
    return [Completion(ids[str(i)], reasons[str(i)]) for i in range(len(prompts))]


def generate_answers(
    engine: LocalEngine,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    copies: EngineCopies | None = None,
) -> list[TrainSequence]:
    """The target's greedy answers (EOS included when it stops on one), as sequences.
    Prompts that leave no room for an answer in the context, and empty answers, are
    dropped. copies: as `complete`'s."""
    context = engine.scheduler.cfg.max_model_len
    kept = [p for p in prompts if p and len(p) + 2 <= context]
    if len(kept) < len(prompts):
        tqdm.write(f"dropped {len(prompts) - len(kept)} prompts longer than the context")
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    answers = complete(engine, kept, [greedy] * len(kept), "generating answers", copies)
    seqs = [TrainSequence(p + a.ids, len(p)) for p, a in zip(kept, answers)]
    return [s for s in seqs if len(s.ids) > s.prompt_len]


def build_draft_vocab(
    seqs: Sequence[TrainSequence], vocab_size: int, draft_vocab_size: int
) -> torch.Tensor:
    """The draft vocabulary: [draft_vocab] target ids, increasing, the
    `draft_vocab_size` most frequent answer tokens (ties to the lower id), filled up
    with the most frequent prompt tokens, then the lowest unused ids. Draft id i is
    target id out[i]; the checkpoint stores d2t = out - arange (`d2t_offsets`)."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} is not in [1, {vocab_size}]")
    answer: Counter[int] = Counter()
    prompt: Counter[int] = Counter()
    for s in seqs:
        answer.update(s.ids[s.prompt_len :])
        prompt.update(s.ids[: s.prompt_len])
    chosen: dict[int, None] = {}  # NOTE: an ordered set
    for counts in (answer, prompt):
        for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) == draft_vocab_size:
                break
            chosen.setdefault(t)
    t = 0
    while len(chosen) < draft_vocab_size:
        chosen.setdefault(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def d2t_offsets(draft_to_target: torch.Tensor) -> torch.Tensor:
    """d2t as checkpoints store it: target id = draft id + d2t[draft id]."""
    return draft_to_target - torch.arange(draft_to_target.numel(), device=draft_to_target.device)
