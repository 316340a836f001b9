"""Workloads of the serving benchmark: random and jsonl prompts, arrivals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gyrfalcon.bench.datasets import (
    arrival_offsets,
    length_bounds,
    load_jsonl_requests,
    poisson_gaps,
    sample_random_requests,
)


class _FakeTokenizer:
    """Ten-token vocabulary; ids 0 and 9 are special."""

    all_special_ids = [0, 9]

    def __len__(self) -> int:
        return 10

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split()]


def test_length_bounds_convention() -> None:
    assert length_bounds(100, 1.0) == (100, 100)
    assert length_bounds(100, 0.5) == (50, 100)
    assert length_bounds(10, 0.0) == (1, 10)
    assert length_bounds(3, 0.1) == (1, 3)
    with pytest.raises(ValueError):
        length_bounds(0, 0.5)
    with pytest.raises(ValueError):
        length_bounds(10, 1.5)


def test_random_lengths_in_range_and_deterministic() -> None:
    kw = dict(
        num_prompts=200, input_len=64, output_len=16, range_ratio=0.25, token_range=(1000, 30000)
    )
    a = sample_random_requests(seed=7, **kw)
    b = sample_random_requests(seed=7, **kw)
    c = sample_random_requests(seed=8, **kw)
    assert a == b and a != c
    assert all(16 <= r.prompt_len <= 64 and len(r.prompt) == r.prompt_len for r in a)
    assert all(4 <= r.output_len <= 16 for r in a)
    assert all(1000 <= t < 30000 for r in a for t in r.prompt)
    assert len({r.prompt_len for r in a}) > 10  # lengths actually vary
    assert min(r.prompt_len for r in a) == 16 or max(r.prompt_len for r in a) == 64


def test_random_ratio_one_is_exact() -> None:
    reqs = sample_random_requests(5, 32, 8, 1.0, seed=0, token_range=(5, 6))
    assert [r.prompt_len for r in reqs] == [32] * 5
    assert [r.output_len for r in reqs] == [8] * 5
    assert reqs[0].prompt == [5] * 32


def test_random_text_prompts_skip_special_tokens() -> None:
    tok = _FakeTokenizer()
    reqs = sample_random_requests(20, 12, 4, 1.0, seed=1, tokenizer=tok, as_text=True)
    for r in reqs:
        assert isinstance(r.prompt, str) and r.prompt_len == 12
        ids = tok.encode(r.prompt)
        assert len(ids) == 12 and all(1 <= i <= 8 for i in ids)
    with pytest.raises(ValueError):
        sample_random_requests(2, 4, 4, 1.0, seed=0, token_range=(1, 9), as_text=True)


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_prompt_and_turns_forms(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"prompt": "hello there", "output_len": 7},
            "",
            {
                "question_id": 81,
                "category": "writing",
                "turns": ["Compose a travel blog post.", "Rewrite it."],
            },
            {"turns": [{"role": "user", "content": "hi from chat"}], "max_tokens": 3},
            {"prompt": [1, 2, 3]},
        ],
    )
    reqs = load_jsonl_requests(path, default_output_len=50)
    assert [r.prompt for r in reqs] == [
        "hello there",
        "Compose a travel blog post.",
        "hi from chat",
        [1, 2, 3],
    ]
    assert [r.output_len for r in reqs] == [7, 50, 3, 50]
    assert [r.prompt_len for r in reqs] == [None, None, None, 3]
    assert len(load_jsonl_requests(path, 50, num_prompts=2)) == 2


def test_jsonl_counts_prompt_tokens_with_tokenizer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "t1 t2 t3"}])
    (req,) = load_jsonl_requests(path, 5, tokenizer=_FakeTokenizer())
    assert req.prompt_len == 3


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        {"text": "no prompt"},
        {"turns": []},
        {"prompt": "x", "output_len": 0},
        {"prompt": 5},
    ],
)
def test_jsonl_bad_lines_name_the_line(tmp_path: Path, bad: object) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, bad])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_jsonl_requests(path, 5)


def test_jsonl_empty_file_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl_requests(path, 5)


def test_poisson_gaps_mean_and_determinism() -> None:
    rate = 4.0
    gaps = poisson_gaps(20000, rate, np.random.default_rng(0))
    assert gaps.min() >= 0.0
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    again = poisson_gaps(20000, rate, np.random.default_rng(0))
    np.testing.assert_array_equal(gaps, again)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert not poisson_gaps(10, math.inf, np.random.default_rng(0)).any()
    assert not arrival_offsets(10, math.inf, np.random.default_rng(0)).any()
    with pytest.raises(ValueError):
        poisson_gaps(3, 0.0, np.random.default_rng(0))


def test_arrival_offsets_start_at_zero_and_grow() -> None:
    offsets = arrival_offsets(100, 10.0, np.random.default_rng(3))
    gaps = poisson_gaps(100, 10.0, np.random.default_rng(3))
    assert offsets[0] == 0.0
    assert np.all(np.diff(offsets) >= 0)
    np.testing.assert_allclose(np.diff(offsets), gaps[:-1])
