"""The speculative-decoding flags (SGLang's names) resolved into draft counts."""

from __future__ import annotations

SPEC_ALGORITHMS = ("EAGLE3",)
DEFAULT_SPEC_STEPS = 3


def resolve_speculative(
    algorithm: str | None,
    draft_path: str | None,
    num_steps: int | None,
    topk: int,
    num_draft_tokens: int | None,
) -> tuple[int | None, int | None]:
    """(k, k + 1) for the speculative flags, or (None, None) without speculation;
    ValueError with the flag's name for a bad combination."""
    if algorithm is None:
        given = {
            "--speculative-draft-model-path": draft_path,
            "--speculative-num-steps": num_steps,
            "--speculative-num-draft-tokens": num_draft_tokens,
        }
        for flag, value in given.items():
            if value is not None:
                raise ValueError(f"{flag} needs --speculative-algorithm EAGLE3")
        return None, None
    if algorithm.upper() not in SPEC_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm!r}: only EAGLE3 is supported")
    if draft_path is None:
        raise ValueError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if topk != 1:
        raise ValueError(
            f"--speculative-eagle-topk {topk}: only 1 (chain drafting) is supported; "
            "tree drafting is not built yet"
        )
    k = num_steps if num_steps is not None else DEFAULT_SPEC_STEPS
    if num_steps is None and num_draft_tokens is not None:
        k = num_draft_tokens - 1
    if k < 1:
        raise ValueError(f"--speculative-num-steps must be at least 1, got {k}")
    if num_draft_tokens is not None and num_draft_tokens != k + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} must be "
            f"--speculative-num-steps + 1 = {k + 1} with chain drafting (topk 1)"
        )
    return k, k + 1
