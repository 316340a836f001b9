"""Instructions the target writes itself (the "Magpie" recipe, Xu et al. 2024).

A chat model that is handed its chat template up to the start of a user message
writes a user message: the kind of request it was tuned on, whatever the prompts
file covers. `--self-instructions N` samples N of them before the answers
(`instruction_prompt`: a one-user-turn conversation rendered without the generation
prompt and cut before the user's content, the template's default system prompt
kept), each with its own seed drawn from --seed, and keeps those that end their
turn (EOS) within INSTRUCTION_MAX_TOKENS, are at least MIN_INSTRUCTION_CHARS long and
are new (`select_instructions`). The kept ones join the file's prompts as ordinary
prompts: answered greedily, eligible for the held-out split and follow-up turns.

With `--instruction-examples K` each instruction's conversation starts with a system
message listing K requests drawn from the training prompts (`examples_system`: a source
of the prompts file drawn evenly, then a request of it), in place of the template's
default system prompt: the target then writes requests more like those (tasks with
their constraints) than the chat openers it writes unprompted. The examples come from
the training prompts only, so they never bring evaluation prompts in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.train.data import Completion, EngineCopies, complete

# NOTE: a string no template writes and none trims or escapes: where the user's text starts
SENTINEL = "GyrfalconUserContentSentinel7c1f"
INSTRUCTION_MAX_TOKENS = 96  # one user message; a longer one is dropped as truncated
INSTRUCTION_TEMPERATURE = 1.0
INSTRUCTION_TOP_P = 0.95
MIN_INSTRUCTION_CHARS = 10
SHOWN_INSTRUCTIONS = 3  # examples in the log
EXAMPLES_HEADER = "You are a helpful AI assistant. Users send you requests like these:"


@dataclass(frozen=True)
class Instructions:
    """The kept instructions in sampling order, and how many were dropped, by reason."""

    kept: list[str]
    dropped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        total = len(self.kept) + sum(self.dropped.values())
        why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items() if n)
        shown = "; ".join(repr(t) for t in self.kept[:SHOWN_INSTRUCTIONS])
        return (
            f"{len(self.kept)} of {total} self-written instructions kept"
            f"{f' (dropped: {why})' if why else ''}{f'; e.g. {shown}' if shown else ''}"
        )


def instruction_prompt(tokenizer: Any, system: str | None = None) -> list[int]:
    """The ids of the chat template up to the start of a user message's content: a
    conversation of one user message (after a `system` message, if given) rendered
    without the generation prompt, cut before that message's text (without `system`,
    a default system prompt stays)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--self-instructions needs a tokenizer with a chat template")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not write the user's message as given")
    return tokenizer.encode(text[: text.index(SENTINEL)], add_special_tokens=False)


def examples_system(pools: Sequence[Sequence[str]], k: int, rng: random.Random) -> str:
    """A system message listing k requests, each from a pool drawn uniformly, then
    drawn uniformly from it (whitespace runs made single spaces: one line each)."""
    picks = [rng.choice(rng.choice(pools)) for _ in range(k)]
    return "\n".join([EXAMPLES_HEADER] + [f"- {' '.join(p.split())}" for p in picks])


def instruction_sampling(n: int, seed: int) -> list[SamplingParams]:
    """N sampling settings, each with its own seed drawn from `seed`: instruction i is
    the same whatever else runs in the batch (the sampler's seeded rows)."""
    rng = random.Random(seed)
    return [
        SamplingParams(
            temperature=INSTRUCTION_TEMPERATURE,
            top_p=INSTRUCTION_TOP_P,
            seed=rng.getrandbits(63),
            max_tokens=INSTRUCTION_MAX_TOKENS,
        )
        for _ in range(n)
    ]


def select_instructions(
    tokenizer: Any,
    completions: Sequence[Completion],
    eos_token_ids: Sequence[int],
    seen: Sequence[str] = (),
) -> Instructions:
    """The completions that ended their turn on EOS, decoded (special tokens dropped)
    and stripped, in order, without the short ones and those already in `seen` or
    earlier in the list."""
    known = set(seen)
    kept: list[str] = []
    dropped = {"truncated": 0, "empty or short": 0, "duplicates": 0}
    for c in completions:
        if c.finish_reason != "stop" or not c.ids or c.ids[-1] not in eos_token_ids:
            dropped["truncated"] += 1
            continue
        text = tokenizer.decode(c.ids[:-1], skip_special_tokens=True).strip()
        if len(text) < MIN_INSTRUCTION_CHARS:
            dropped["empty or short"] += 1
        elif text in known:
            dropped["duplicates"] += 1
        else:
            known.add(text)
            kept.append(text)
    return Instructions(kept, dropped)


def write_instructions(
    engine: LocalEngine,
    tokenizer: Any,
    n: int,
    seed: int,
    seen: Sequence[str] = (),
    copies: EngineCopies | None = None,
    example_pools: Sequence[Sequence[str]] = (),
    num_examples: int = 0,
) -> Instructions:
    """N user instructions sampled from the target (module docstring), filtered by
    `select_instructions` (`seen`: the prompts there already); copies: as
    `data.complete`'s (each instruction's own seed makes it the same either way).
    num_examples > 0: each prompt lists that many requests of `example_pools`
    (`examples_system`, drawn with `seed`)."""
    if num_examples:
        pools = [p for p in example_pools if p]
        if not pools:
            raise ValueError("--instruction-examples needs training prompts to draw from")
        rng = random.Random(f"instruction examples {seed}")
        prompts = [
            instruction_prompt(tokenizer, examples_system(pools, num_examples, rng))
            for _ in range(n)
        ]
    else:
        prompts = [instruction_prompt(tokenizer)] * n
    sampling = instruction_sampling(n, seed)
    completions = complete(engine, prompts, sampling, "writing instructions", copies)
    return select_instructions(tokenizer, completions, engine.model_cfg.eos_token_ids, seen)
