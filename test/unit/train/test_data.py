"""Training data: prompts files (evaluation sets refused), the chat template, the draft
vocabulary and its d2t, the arguments' checks."""

from __future__ import annotations

import json

import pytest
import torch

from gyrfalcon.cli import main as cli_main
from gyrfalcon.loader.eagle3 import draft_to_target_ids
from gyrfalcon.train.args import TrainArgs
from gyrfalcon.train.data import (
    TrainSequence,
    build_draft_vocab,
    d2t_offsets,
    encode_prompts,
    load_prompts,
)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_draft_vocab_is_the_most_frequent_answer_tokens_in_id_order():
    seqs = [
        TrainSequence([9, 9, 9, 5, 5, 7, 7, 7, 7, 3], prompt_len=3),  # answer: 5 5 7 7 7 7 3
        TrainSequence([1, 3, 3, 5], prompt_len=1),  # answer: 3 3 5
    ]
    # answer counts: 7 x4, 5 x3, 3 x3 (tie: lower id first), then prompt counts: 9 x3, 1 x1
    assert build_draft_vocab(seqs, 16, 2).tolist() == [3, 7]
    assert build_draft_vocab(seqs, 16, 3).tolist() == [3, 5, 7]
    assert build_draft_vocab(seqs, 16, 4).tolist() == [3, 5, 7, 9]
    # then the lowest ids not yet chosen
    assert build_draft_vocab(seqs, 16, 7).tolist() == [0, 1, 2, 3, 5, 7, 9]
    assert build_draft_vocab(seqs, 10, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match="draft_vocab_size 9"):
        build_draft_vocab(seqs, 8, 9)


def test_d2t_is_what_checkpoints_store():
    ids = torch.tensor([3, 5, 7, 9])
    d2t = d2t_offsets(ids)
    assert d2t.tolist() == [3, 4, 5, 6]
    assert torch.equal(torch.arange(4) + d2t, ids)
    # the loader's check reads it back to the same vocabulary
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[ids] = True
    assert torch.equal(draft_to_target_ids(d2t, t2d, 16, 4), ids)


def test_load_prompts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "id": i} for i in range(10)])
    all_ = load_prompts(path, 0, seed=1)
    assert sorted(all_) == sorted(f"q{i}" for i in range(10)) and all_ != sorted(all_)
    assert load_prompts(path, 4, seed=1) == all_[:4]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(ValueError, match="bad.jsonl:2: no non-empty 'prompt'"):
        load_prompts(bad, 0, seed=0)


class FakeTokenizer:
    chat_template = "user: {{ content }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}<assistant>"

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [len(w) for w in text.split()]


def test_encode_prompts_with_and_without_the_chat_template():
    tok = FakeTokenizer()
    assert encode_prompts(tok, ["ab cde"], chat_template=True) == [[8, 14]]
    assert encode_prompts(tok, ["ab cde"], chat_template=False) == [[1, 2, 3]]
    tok.chat_template = None
    with pytest.raises(ValueError, match="--no-chat-template"):
        encode_prompts(tok, ["x"], chat_template=True)


@pytest.mark.parametrize("name", ["mt_bench_dev.jsonl", "MT-Bench/question.jsonl"])
def test_an_evaluation_set_is_refused(tmp_path, name, capsys):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [{"prompt": "What is 2 + 2?"}])
    with pytest.raises(ValueError, match="evaluation set"):
        TrainArgs(prompts=str(path), output_dir=str(tmp_path / "out")).resolved()
    argv = ["train-eagle3", "--prompts", str(path), "--output-dir", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert "MT-Bench, an evaluation set" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prompts_and_output_dir_are_required(tmp_path, capsys):
    assert cli_main(["train-eagle3", "--output-dir", str(tmp_path)]) == 2
    assert "--prompts is required" in capsys.readouterr().err
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    assert cli_main(["train-eagle3", "--prompts", path]) == 2
    assert "--output-dir is required" in capsys.readouterr().err
    assert (
        cli_main(
            [
                "train-eagle3",
                "--prompts",
                str(tmp_path / "none.jsonl"),
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "none.jsonl" in capsys.readouterr().err


def test_resolved_defaults():
    args = TrainArgs(prompts="p.jsonl", output_dir="out", device="cpu", max_steps=100).resolved()
    assert args.dtype == "float32" and args.warmup_steps == 5 and args.ttt_steps == 4
    with pytest.raises(ValueError, match="--ttt-steps must be at least 1"):
        TrainArgs(prompts="p.jsonl", output_dir="out", ttt_steps=0).resolved()
    assert args.target_temperature == 1.0  # EAGLE3's soft targets unless asked
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match="--target-temperature must be positive"):
            TrainArgs(prompts="p.jsonl", output_dir="out", target_temperature=bad).resolved()
    assert args.reach_weight == 0.0  # every row alike unless asked
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"--reach-weight must be in \[0, 1\]"):
            TrainArgs(prompts="p.jsonl", output_dir="out", reach_weight=bad).resolved()
