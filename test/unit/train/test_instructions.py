"""--self-instructions: the target writes user instructions from its chat template's
user position (the default system prompt kept); truncated, short and duplicate ones
are dropped; the same --seed writes the same ones; they join the prompts (the
end-to-end run is in test_train_cli.py). Engine copies in other processes
(--generate-workers) give what one engine gives."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_tiny_hf_model

from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.train.args import TrainArgs
from gyrfalcon.train.data import Completion, EngineCopies, generate_answers, prompts_by_source
from gyrfalcon.train.instructions import (
    EXAMPLES_HEADER,
    examples_system,
    instruction_prompt,
    select_instructions,
    write_instructions,
)

EOS = 2  # make_tiny_hf_model's eos_token_id; it ends a turn, as <|im_end|> does SmolLM2's
# ChatML-like, in the synthetic tokenizer's words: <10> system, <11> user, <12> assistant;
# a default system prompt (<7> <8>) when the conversation has none
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<10> <7> <8> <2>\n{% endif %}"
    "{% for m in messages %}"
    "{{ {'system': '<10>', 'user': '<11>', 'assistant': '<12>'}[m['role']] }} "
    "{{ m['content'] }} <2>\n{% endfor %}"
    "{% if add_generation_prompt %}<12>{% endif %}"
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(a tiny random target's directory, its tokenizer with TEMPLATE)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("self-instructions")
    target_dir, tok_dir = str(root / "target"), str(root / "tokenizer")
    make_tiny_hf_model(target_dir, "llama")
    make_synthetic_tokenizer(target_dir, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = TEMPLATE
    return target_dir, tok


@pytest.fixture(scope="module")
def engine(target):
    target_dir = target[0]
    args = ServerArgs(model=target_dir, device="cpu", dtype="float32", kv_cache_memory="16MiB")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny tensors (test_train_cli.py's one_thread)
    yield LocalEngine(args, target_dir)
    torch.set_num_threads(threads)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_the_prompt_is_the_template_up_to_the_users_text(target):
    _, tok = target
    prompt = instruction_prompt(tok)
    assert prompt == [10, 7, 8, EOS, 11]  # the system prompt, then a user turn's header
    # a rendered conversation holds exactly that before the user's text
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<5> <6>"}], tokenize=False, add_generation_prompt=False
    )
    assert encode(tok, text) == prompt + [5, 6, EOS]


@pytest.mark.slow
def test_smollm2s_prompt_is_its_system_prompt_and_a_user_header(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.decode(instruction_prompt(tok)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\n"
    )


def test_a_tokenizer_without_a_chat_template_is_refused(target):
    _, tok = target
    bare = type(tok).from_pretrained(tok.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        instruction_prompt(bare)
    args = TrainArgs(prompts="p.jsonl", output_dir="o", self_instructions=8, no_chat_template=True)
    with pytest.raises(ValueError, match="--self-instructions needs the chat template"):
        args.resolved()


def test_only_whole_new_instructions_of_ten_characters_are_kept(target):
    _, tok = target
    done = [
        ("<5> <6> <7>", "stop"),  # kept (11 characters)
        ("<5> <6> <7>", "length"),  # never ended its turn: truncated
        ("<5> <6>", "stop"),  # 7 characters: short
        ("", "stop"),  # empty
        ("<5> <6> <7>", "stop"),  # a duplicate of the first
        ("<40> <41> <42>", "stop"),  # one of the file's prompts
        ("<100> <101>", "stop"),  # kept
    ]
    completions = [
        Completion(encode(tok, text) + ([EOS] if why == "stop" else []), why) for text, why in done
    ]
    completions += [Completion([], "error"), Completion(encode(tok, "<9> <9> <9>"), "stop")]
    got = select_instructions(tok, completions, [EOS], seen=["<40> <41> <42>"])
    assert got.kept == ["<5> <6> <7>", "<100> <101>"]
    assert got.dropped == {"truncated": 3, "empty or short": 2, "duplicates": 2}
    assert got.summary().startswith("2 of 9 self-written instructions kept (dropped: 3 trunc")


def test_the_target_writes_them_reproducibly_from_the_seed(target, engine):
    _, tok = target
    first = write_instructions(engine, tok, 24, seed=0)
    # 24 sampled, each kept or dropped; some of each on this target
    assert len(first.kept) + sum(first.dropped.values()) == 24
    assert first.kept and first.dropped["truncated"]
    assert write_instructions(engine, tok, 24, seed=0) == first
    other = write_instructions(engine, tok, 24, seed=1)
    assert other.kept != first.kept


class _BadCopies:
    """The engine for share 0, but a model directory no copy can load."""

    def __init__(self, engine):
        self.engine, self.args, self.model_dir = engine, engine.args, "/nonexistent/model"

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_engine_copies_in_other_processes_write_and_answer_the_same(target, engine):
    """--generate-workers 2: an engine copy in a spawned process, started once, takes
    half the prompts of every call; the sampled instructions (each its own seed) and
    the greedy answers are the ones one engine gives, in the prompts' order."""
    _, tok = target
    alone = write_instructions(engine, tok, 12, seed=3)
    prompts = [encode(tok, f"<{20 + i}> <{30 + i}> <{40 + i}>") for i in range(6)]
    want = generate_answers(engine, prompts, 8)
    with EngineCopies(engine, 2) as copies:
        assert write_instructions(engine, tok, 12, seed=3, copies=copies) == alone
        assert generate_answers(engine, prompts, 8, copies) == want
        proc = copies.procs[0]
        # where each call's time went, for the trainer's log
        assert [name for name, *_ in copies.calls] == ["writing instructions", "generating answers"]
        assert all(own > 0 and waited >= 0 for _, own, waited in copies.calls)
        assert copies.summary().startswith("writing instructions: share 0 ")
    assert not proc.is_alive() and proc.exitcode == 0  # closed with the context
    # a copy that cannot start: the error names it, share 0's requests all finished
    with EngineCopies(_BadCopies(engine), 2) as copies:
        with pytest.raises(RuntimeError, match="generation worker 1 of 2: .*nonexistent"):
            generate_answers(engine, prompts, 8, copies)
    assert not engine.has_work()


def test_example_requests_come_from_every_source_alike(tmp_path):
    """--instruction-examples: the prompts grouped by the file's sources, then each
    example drawn from a source chosen evenly, so a source of 2 prompts among 100 is
    listed as often as the big one; one line each, the same from the same seed."""
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": f"math {i}", "source": "math"} for i in range(98)]
    lines += [
        {"prompt": "write\n  a poem", "source": "tasks"},
        {"prompt": "sum up", "source": "tasks"},
    ]
    lines += [{"prompt": "no source"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    drawn = [r["prompt"] for r in lines]
    pools = prompts_by_source(str(path), drawn)
    assert pools == [["no source"], drawn[:98], ["write\n  a poem", "sum up"]]
    # only the drawn prompts (the training ones) are ever examples
    assert prompts_by_source(str(path), drawn[:3]) == [drawn[:3]]
    text = examples_system(pools, 3000, random.Random(0))
    first, *listed = text.split("\n")
    assert first == EXAMPLES_HEADER and len(listed) == 3000
    from_tasks = sum(x in ("- write a poem", "- sum up") for x in listed)
    from_math = sum(x.startswith("- math ") for x in listed)
    assert abs(from_tasks - 1000) < 100 and abs(from_math - 1000) < 100
    assert examples_system(pools, 5, random.Random(1)) == examples_system(
        pools, 5, random.Random(1)
    )


def test_examples_are_a_system_message_before_the_users_turn(target, engine):
    _, tok = target
    prompt = instruction_prompt(tok, "<30> <31>")
    assert prompt == [10, 30, 31, EOS, 11]  # in place of the default system prompt
    pools = [[f"<{40 + i}> <{50 + i}>" for i in range(4)], ["<60> <61> <62>"]]
    with_examples = write_instructions(engine, tok, 24, 0, example_pools=pools, num_examples=2)
    assert write_instructions(engine, tok, 24, 0, example_pools=pools, num_examples=2) == (
        with_examples
    )
    assert with_examples.kept != write_instructions(engine, tok, 24, seed=0).kept
    with pytest.raises(ValueError, match="--instruction-examples needs training prompts"):
        write_instructions(engine, tok, 4, 0, example_pools=[[]], num_examples=2)
    args = TrainArgs(prompts="p.jsonl", output_dir="o", instruction_examples=3)
    with pytest.raises(ValueError, match="--instruction-examples needs --self-instructions"):
        args.resolved()
